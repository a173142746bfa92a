"""`python -m course_lib doctor`: what this machine can run, and a 2-rank smoke test (notebooks/00_start_here.ipynb)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

# Set by the notebook services themselves (Kaggle's own client library, kagglehub, reads the same variables).
HOSTS = (("KAGGLE_KERNEL_RUN_TYPE", "Kaggle"), ("COLAB_RELEASE_TAG", "Google Colab"))
_OS = {"Darwin": "macOS"}


def _gpus() -> list[str]:
    from ..runtime.devices import gpu_count

    n = gpu_count()
    if n == 0:
        return []
    import torch

    out = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        # torch.cuda.is_bf16_supported's own rule: native bfloat16 from compute capability 8.0 (Ampere) on.
        bf16 = "bf16 yes" if p.major >= 8 else "bf16 no (emulated, slow)"
        out.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}, "
                   f"{bf16}")
    return out


def nccl_version() -> str | None:
    """The NCCL this torch build carries (torch.cuda.nccl.version()), None without one. Nodes of one job must agree
    on it, and NCCL_DEBUG=INFO prints its "NCCL version" line from rank 0 only, so doctor says it on every node."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version[:3])) + (f"+{version[3]}" if len(version) > 3 else "")


def what_runs_here(gpus: int, most_ranks: int | None) -> list[str]:
    """Which lessons this machine runs: gloo ones everywhere, NCCL ones with one GPU per rank."""
    host = next((name for var, name in HOSTS if var in os.environ), None)
    cap = f"up to {most_ranks} ranks by memory and open files" if most_ranks else "any world size"
    lines = [f"gloo lessons (every notebook): yes, {cap}"]
    if gpus >= 2:
        lines.append(f"NCCL lessons: up to {gpus} ranks, one GPU each (the 2-rank NCCL cells run here)")
    elif gpus == 1:
        lines.append("NCCL lessons: 1 rank only (one GPU per rank); multi-rank cells use gloo on the CPU")
    else:
        lines.append("NCCL lessons: need GPUs; every cell runs its gloo path here")
    if host:
        lines.append(f"notebook host: {host}")
    return lines


def _python() -> str:
    """The interpreter, relative to the course's folder or the current one when it lives below it (a .venv)."""
    exe = sys.executable
    course = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for base in (course, os.getcwd()):
        try:
            rel = os.path.relpath(exe, base)
        except ValueError:  # another drive
            continue
        if not rel.startswith(".."):
            return rel
    return exe


def _topology() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "nvidia-smi not found (no NVIDIA driver here): no GPU interconnect to show"
    try:
        done = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi topo -m failed: {exc}"
    return (done.stdout or done.stderr).rstrip()


# Families that carry Chinese glyphs, for a machine without fontconfig's fc-list (macOS, Windows).
_CJK_FAMILIES = ("CJK", "PingFang", "Hiragino", "Heiti", "Songti", "YaHei", "SimHei", "SimSun", "Source Han")


def cjk_fonts() -> list[str]:
    """Font families installed here that hold Chinese glyphs: fontconfig's answer, else matplotlib's font list."""
    if shutil.which("fc-list"):
        try:
            done = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return []
        return sorted({ln.split(",")[0].strip() for ln in done.stdout.splitlines() if ln.strip()})
    from matplotlib import font_manager

    return sorted({f.name for f in font_manager.fontManager.ttflist if any(k in f.name for k in _CJK_FAMILIES)})


def font_line() -> str:
    """Doctor's line about the notebooks' Chinese terms: which CJK font shows them, or how to get one."""
    fonts = cjk_fonts()
    if fonts:
        more = f" (+{len(fonts) - 1} more)" if len(fonts) > 1 else ""
        return f"  CJK font      {fonts[0]}{more}: the notebooks' Chinese terms show"
    # the Chinese terms are in markdown, drawn by the browser: a font here matters only if the browser runs here
    return ("  CJK font      none on this machine: matters only if your browser runs here (the notebooks' Chinese "
            "terms would show as empty boxes); Debian/Ubuntu: sudo apt install fonts-noto-cjk")


def _smoke(world_size: int, backend: str) -> tuple[bool, str]:
    import torch
    import torch.distributed as dist

    from ..runtime.devices import device
    from ..runtime.launch import run

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
    from ..runtime.machine_limits import WINDOWS, max_ranks

    if sys.platform.startswith(("win32", "cygwin")):
        print(f"course_lib doctor\n  platform      Windows ({platform.machine()})\n  {WINDOWS}", file=out, flush=True)
        return False
    import torch

    from ..runtime.devices import backend_available, plan
    from ..runtime.results import LaunchError

    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    build = f"CUDA {cuda} build" if cuda else ("ROCm build" if hip else "CPU-only build")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    nccl = nccl_version()
    version = {"nccl": f" (NCCL {nccl})" if nccl else ""}
    have = ", ".join(f"{b} {'yes' if backend_available(b) else 'no'}{version.get(b, '')}"
                     for b in ("gloo", "nccl", "mpi"))
    gpus = _gpus()
    lines = [
        "course_lib doctor",
        f"  platform      {_OS.get(platform.system(), platform.system())} ({platform.machine()})",
        f"  python        {platform.python_version()} ({_python()})",
        f"  torch         {torch.__version__} ({build})",
        f"  backends      {have}",
        f"  cpu cores     {os.cpu_count()}",
        f"  GPUs          {len(gpus) or 'none visible'}"
        + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""),
        *[f"                {g}" for g in gpus],
        "  interconnect  " + _topology().replace("\n", "\n                "),
        font_line(),
    ]
    for n in (2, 4, 8):
        p = plan("auto", n)
        lines.append(f"  auto, {n} ranks {p.backend} on {', '.join(sorted(set(p.devices)))} ({p.reason})")
    lines += [("  runs here     " if i == 0 else "                ") + line
              for i, line in enumerate(what_runs_here(len(gpus), max_ranks()))]
    print("\n".join(lines), file=out, flush=True)
    try:
        plan(backend, world_size)
    except LaunchError as exc:
        print(f"  smoke test    not run: {exc}", file=out)
        return False
    ok, msg = _smoke(world_size, backend)
    print(f"  smoke test    {msg}", file=out, flush=True)
    return ok
