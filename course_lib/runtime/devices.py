"""What hardware is here, and which backend and device each rank gets ("auto": NCCL with one GPU per rank, else gloo).

Taught in notebooks/00_start_here.ipynb. Everything here is decided before any process starts, so a request that
cannot work is refused with a sentence saying what to do instead: NCCL needs a GPU of its own for every rank (two
ranks on one GPU fail with "Duplicate GPU detected"), and a torch build without NCCL has none.

The GPU rule, the same for `run` and for torchrun workers: the ranks of one node take that node's GPUs in order,
rank LOCAL_RANK the GPU at position LOCAL_RANK. A node's GPUs are all the GPUs its processes see (cuda:0..N-1), or
the list in LAB_GPUS when several "nodes" share one machine (labs/torchrun.run_nodes gives each its own GPUs, or
none, so no two nodes pick the same one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .results import LaunchError

BACKENDS = ("auto", "gloo", "nccl", "mpi")


@dataclass(frozen=True)
class Plan:
    """The backend chosen for a launch and the device of each rank."""

    backend: str
    devices: tuple[str, ...]
    reason: str

    @property
    def world_size(self) -> int:
        return len(self.devices)


def gpu_count() -> int:
    """Visible CUDA GPUs, counted without initialising CUDA in this process (NVML-based where torch offers it)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    if not torch.backends.cuda.is_built() and not getattr(torch.version, "hip", None):
        return 0
    try:
        return torch.cuda.device_count()
    except Exception:  # a broken driver counts as no GPU: gloo still works
        return 0


def backend_available(name: str) -> bool:
    import torch.distributed as dist

    return {
        "gloo": dist.is_gloo_available,
        "nccl": dist.is_nccl_available,
        "mpi": dist.is_mpi_available,
    }[name]()


def _visible_note() -> str:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else ""


def plan(backend: str = "auto", world_size: int = 4, gpus: int | None = None, available=None) -> Plan:
    """Choose backend and per-rank devices, or raise LaunchError; ``gpus``/``available`` override detection in tests."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise LaunchError(f"world_size must be a whole number of ranks, like 4; got {world_size!r}.")
    if world_size < 1:
        raise LaunchError(f"world_size must be at least 1 (one process per rank); got {world_size}.")
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise LaunchError(
            f"Unknown backend {backend!r}. Use 'auto' (NCCL when there is one GPU per rank, else gloo), "
            "'gloo' (CPU, works everywhere), 'nccl' (one GPU per rank) or 'mpi' (torch built with MPI)."
        )
    backend = backend.lower()
    # The GPU rule holds for run() too: LAB_GPUS, when set, names this node's GPUs (node_gpus below).
    chosen = node_gpus() if gpus is None else list(range(gpus))
    gpus = len(chosen)
    available = available or backend_available

    if backend == "auto":
        if gpus >= world_size and available("nccl"):
            return Plan("nccl", tuple(f"cuda:{chosen[r]}" for r in range(world_size)),
                        f"{gpus} GPU(s) for {world_size} ranks")
        if gpus == 0:
            why = "no GPU here"
        elif not available("nccl"):
            why = "this torch build has no NCCL"
        else:
            why = f"only {gpus} GPU(s) for {world_size} ranks"
        return Plan("gloo", ("cpu",) * world_size, why)

    if backend == "nccl":
        if not available("nccl") or gpus == 0:
            raise LaunchError(
                "NCCL needs one CUDA GPU per rank, and this machine has no usable GPU"
                f"{_visible_note()} or this torch build has no NCCL. Use backend='gloo' (CPU) instead."
            )
        if world_size > gpus:
            raise LaunchError(
                f"You asked for {world_size} NCCL ranks but only {gpus} GPU(s) are visible{_visible_note()}; "
                f"NCCL needs one GPU per rank (two ranks on one GPU fail with 'Duplicate GPU detected'). "
                f"Use world_size={gpus} or fewer, or backend='gloo' to run {world_size} ranks on the CPU."
            )
        return Plan("nccl", tuple(f"cuda:{chosen[r]}" for r in range(world_size)), "NCCL, one GPU per rank")

    if not available(backend):
        hint = "Use backend='gloo' instead."
        if backend == "mpi":
            hint = "The pip and conda builds of torch do not include MPI; use backend='gloo' instead."
        raise LaunchError(f"This torch build has no {backend!r} backend. {hint}")
    return Plan(backend, ("cpu",) * world_size, f"{backend} on CPU, as asked")


LAB_GPUS = "LAB_GPUS"   # a node's own GPUs, as indexes this process sees: "2,3"; "" for none (CPU only)


def node_gpus(env=None, count: int | None = None) -> list[int]:
    """The GPUs of this node's workers in LOCAL_RANK order: LAB_GPUS when set, else every visible GPU (0..count-1)."""
    env = os.environ if env is None else env
    if LAB_GPUS in env:
        return [int(g) for g in env[LAB_GPUS].split(",") if g.strip()]
    return list(range(gpu_count() if count is None else count))


def node_gpu(local_rank: int, env=None, count: int | None = None) -> int:
    """The GPU index of worker LOCAL_RANK on its node (see the GPU rule above), or a LaunchError naming the shortage."""
    env = os.environ if env is None else env
    gpus = node_gpus(env, count)
    if not 0 <= local_rank < len(gpus):
        where = f"{LAB_GPUS}={env[LAB_GPUS]!r}" if LAB_GPUS in env else "this machine"
        raise LaunchError(f"LOCAL_RANK {local_rank} has no GPU of its own: {where} gives this node {len(gpus)} GPU(s). "
                          "Start at most that many workers per node for NCCL, or use gloo.")
    return gpus[local_rank]


def device():
    """This rank's torch.device: its own GPU under NCCL (node_gpu of LOCAL_RANK), else cpu; the launcher's choice
    (COURSE_DEVICE) when it started the rank."""
    import torch

    name = os.environ.get("COURSE_DEVICE")
    if name:
        return torch.device(name)
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", node_gpu(int(os.environ.get("LOCAL_RANK", "0"))))
    return torch.device("cpu")
