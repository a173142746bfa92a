"""A simulated multi-GPU machine, for tests on a machine without GPUs: what torch and course_lib see there, and which
physical GPU every rank of a launch ends up on.

Use the fixture (import it into a test module, or into conftest.py)::

    from tests.gpu_plan import simulated_gpus_fixture  # noqa: F401  (registers the fixture "simulated_gpus")

    def test_kaggle(simulated_gpus):
        machine = simulated_gpus(2, name="Tesla T4", bf16=False)          # Kaggle's 2 x T4
        assert course_lib.plan("auto", 2).backend == "nccl"
        placed = torchrun_placement(machine, nnodes=2, nproc=1)            # two torchrun "nodes" on this host
        assert_no_gpu_shared(placed)

While installed, torch.cuda.is_available/device_count/set_device/current_device/is_initialized/get_device_name/
get_device_capability/is_bf16_supported, torch.backends.cuda.is_built, torch.distributed.is_nccl_available and
course_lib.runtime.devices.gpu_count answer as that machine would; CUDA_VISIBLE_DEVICES is honoured as CUDA
honours it (the listed GPUs, in that order, up to the first entry that names no GPU). Nothing starts a process
or touches CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

import course_lib.runtime.devices
from course_lib.runtime.devices import LAB_GPUS


@dataclass
class Machine:
    """`gpus` identical GPUs; set_device calls are recorded as (visible index, physical GPU)."""

    gpus: int
    nccl: bool = True
    name: str = "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int] = (9, 0)
    bf16: bool = True
    cuda_initialized: bool = False
    current: int = 0
    set_calls: list = field(default_factory=list)

    def visible(self) -> list[int]:
        """Physical GPU ids this process sees, in cuda:N order."""
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        if cvd is None:
            return list(range(self.gpus))
        out = []
        for entry in cvd.split(","):
            entry = entry.strip()
            if not entry.isdigit() or int(entry) >= self.gpus or int(entry) in out:
                break                  # CUDA stops at the first entry that names no (new) device
            out.append(int(entry))
        return out

    def device_count(self) -> int:
        return len(self.visible())

    def physical(self, index: int) -> int:
        """The physical GPU behind cuda:index, or the error torch gives for a GPU that is not there."""
        seen = self.visible()
        if not 0 <= index < len(seen):
            raise RuntimeError(f"CUDA error: invalid device ordinal (cuda:{index} of {len(seen)} visible)")
        return seen[index]

    def set_device(self, dev) -> None:
        index = dev.index if isinstance(dev, torch.device) else int(dev)
        self.set_calls.append((index, self.physical(index)))
        self.current = index
        self.cuda_initialized = True

    def install(self, monkeypatch) -> Machine:
        cuda = torch.cuda
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
        monkeypatch.setattr(cuda, "is_available", lambda: self.device_count() > 0)
        monkeypatch.setattr(cuda, "device_count", self.device_count)
        monkeypatch.setattr(cuda, "set_device", self.set_device)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "is_initialized", lambda: self.cuda_initialized)
        monkeypatch.setattr(cuda, "get_device_name", lambda d=None: self.name)
        monkeypatch.setattr(cuda, "get_device_capability", lambda d=None: self.capability)
        monkeypatch.setattr(cuda, "is_bf16_supported", lambda *a, **k: self.bf16)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: self.nccl)
        monkeypatch.setattr(course_lib.runtime.devices, "gpu_count", self.device_count)
        return self


@pytest.fixture(name="simulated_gpus")
def simulated_gpus_fixture(monkeypatch):
    """simulated_gpus(count, **Machine fields) installs a simulated machine for the test and returns it."""
    def make(gpus: int, **kw) -> Machine:
        return Machine(gpus, **kw).install(monkeypatch)
    return make


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: its backend and its physical GPU (None: CPU)."""

    rank: int
    node: int
    local_rank: int
    backend: str
    gpu: int | None


def _restore(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def launcher_placement(machine: Machine, world_size: int, backend: str = "auto") -> list[Placement]:
    """Ranks started by course_lib.run: the kernel's plan, then each rank's device() with the launcher's
    COURSE_DEVICE in its environment."""
    the_plan = course_lib.runtime.devices.plan(backend, world_size)
    out = []
    for rank, name in enumerate(the_plan.devices):
        saved = os.environ.get("COURSE_DEVICE")
        os.environ["COURSE_DEVICE"] = name
        try:
            dev = course_lib.runtime.devices.device()
        finally:
            _restore({"COURSE_DEVICE": saved})
        gpu = machine.physical(dev.index or 0) if dev.type == "cuda" else None
        out.append(Placement(rank, 0, rank, the_plan.backend, gpu))
    return out


def torchrun_placement(machine: Machine, nnodes: int, nproc: int, backend: str = "auto") -> list[Placement]:
    """Workers of `nnodes` torchrun "nodes" of `nproc` each started on this machine by labs.torchrun.run_nodes:
    each node's LAB_GPUS as run_nodes sets it, then labs.group.choose in each worker's environment."""
    from course_lib.labs.group import choose
    from course_lib.labs.torchrun import split_gpus

    out = []
    for node, gpus in enumerate(split_gpus(nnodes, nproc).per_node):
        for local_rank in range(nproc):
            saved = {k: os.environ.get(k) for k in (LAB_GPUS, "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
            os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nproc))
            if gpus is None:
                os.environ.pop(LAB_GPUS, None)
            else:
                os.environ[LAB_GPUS] = gpus
            try:
                chosen, dev = choose(local_rank, nproc, backend)
            finally:
                _restore(saved)
            gpu = machine.physical(dev.index) if dev.type == "cuda" else None
            out.append(Placement(node * nproc + local_rank, node, local_rank, chosen, gpu))
    return out


def assert_no_gpu_shared(placed: list[Placement]) -> None:
    """Every rank picked the same backend, and under NCCL no two ranks share a physical GPU."""
    backends = {p.backend for p in placed}
    assert len(backends) == 1, f"ranks disagree on the backend: {placed}"
    if backends == {"nccl"}:
        gpus = [p.gpu for p in placed]
        assert None not in gpus and len(set(gpus)) == len(gpus), f"two NCCL ranks on one GPU: {placed}"
