"""`python -m course_lib doctor`: what this machine can run, and a 2-rank smoke test (notebooks/00_start_here.ipynb)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys


def _gpus() -> list[str]:
    from .devices import gpu_count

    n = gpu_count()
    if n == 0:
        return []
    import torch

    out = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        out.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
    return out


def _topology() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "nvidia-smi not found (no NVIDIA driver here): no GPU interconnect to show"
    try:
        done = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi topo -m failed: {exc}"
    return (done.stdout or done.stderr).rstrip()


def _smoke(world_size: int, backend: str) -> tuple[bool, str]:
    import torch
    import torch.distributed as dist

    from .devices import device
    from .launch import run

    def smoke():
        t = torch.tensor([dist.get_rank() + 1.0], device=device())
        dist.all_reduce(t)
        return t.item()

    expected = world_size * (world_size + 1) / 2
    try:
        res = run(smoke, world_size, backend=backend, timeout=60, output="none")
    except Exception as exc:  # the reason is the report
        return False, f"FAILED: {type(exc).__name__}: {exc}"
    ok = all(v == expected for v in res.values)
    verdict = "OK" if ok else "WRONG"
    return ok, (f"{verdict}: all_reduce of rank+1 on {world_size} ranks ({res.backend}) gave {res.values}, "
                f"expected {expected:g} on every rank, in {res.wall_s:.2f} s")


def report(world_size: int = 2, backend: str = "auto", out=None) -> bool:
    """Print what this machine offers and run the smoke test; True when it passed."""
    out = out or sys.stdout
    import torch

    from .devices import LaunchError, backend_available, plan

    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    build = f"CUDA {cuda} build" if cuda else ("ROCm build" if hip else "CPU-only build")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    have = ", ".join(f"{b} {'yes' if backend_available(b) else 'no'}" for b in ("gloo", "nccl", "mpi"))
    gpus = _gpus()
    lines = [
        "course_lib doctor",
        f"  python        {platform.python_version()} ({sys.executable})",
        f"  torch         {torch.__version__} ({build})",
        f"  backends      {have}",
        f"  cpu cores     {os.cpu_count()}",
        f"  GPUs          {len(gpus) or 'none visible'}"
        + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""),
        *[f"                {g}" for g in gpus],
        "  interconnect  " + _topology().replace("\n", "\n                "),
    ]
    for n in (2, 4, 8):
        p = plan("auto", n)
        lines.append(f"  auto, {n} ranks {p.backend} on {', '.join(sorted(set(p.devices)))} ({p.reason})")
    print("\n".join(lines), file=out, flush=True)
    try:
        plan(backend, world_size)
    except LaunchError as exc:
        print(f"  smoke test    not run: {exc}", file=out)
        return False
    ok, msg = _smoke(world_size, backend)
    print(f"  smoke test    {msg}", file=out, flush=True)
    return ok
