"""The CUDA paths, for a machine with GPUs: skipped (and reported as skipped) where there is none, as on CI.

Run on a GPU machine with ``pytest tests/test_gpu.py -v``; one GPU is enough (NCCL with one rank per GPU).
"""

import subprocess
import sys

import pytest
import torch

from course_lib import device, plan, run
from course_lib.devices import gpu_count

GPUS = gpu_count()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU (this machine has none)")
N = min(GPUS, 4)


def _nccl_all_reduce():
    import torch.distributed as dist

    t = torch.full((1000,), float(dist.get_rank() + 1), device=device())
    dist.all_reduce(t)
    return dist.get_backend(), str(t.device), torch.cuda.current_device(), t


def test_auto_picks_nccl_with_one_gpu_per_rank():
    p = plan("auto", N)
    assert p.backend == "nccl" and p.devices == tuple(f"cuda:{r}" for r in range(N))


def test_nccl_ranks_use_their_own_gpu_and_results_come_back_on_cpu():
    res = run(_nccl_all_reduce, N, backend="nccl", timeout=120, output="none")
    for rank, (backend, where, current, t) in enumerate(res.values):
        assert backend == "nccl" and where == f"cuda:{rank}" and current == rank
        assert t.device.type == "cpu" and torch.all(t == N * (N + 1) / 2)


def test_launching_still_works_after_cuda_is_initialised_in_the_kernel():
    torch.zeros(1, device="cuda")  # the kernel touches CUDA first, as a learner's cell would
    assert torch.cuda.is_initialized()
    res = run(_nccl_all_reduce, N, timeout=120, output="none")
    assert all(torch.all(v[3] == N * (N + 1) / 2) for v in res.values)


def test_interactive_ranks_on_gpus():
    from course_lib.interactive import Ranks

    with Ranks(N, backend="nccl", timeout=60) as group:
        group.run_cell("t = torch.ones(3, device=device) * (rank + 1)\ndist.all_reduce(t)", show=False)
        values = group.pull("t")
    assert all(torch.all(v == N * (N + 1) / 2) for v in values)


def test_doctor_lists_the_gpus_and_passes_its_nccl_smoke_test():
    done = subprocess.run([sys.executable, "-m", "course_lib", "doctor", "--ranks", str(N), "--backend", "nccl"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cuda:0" in done.stdout and "smoke test    OK" in done.stdout


def test_gpu_copy_ceilings_are_measured():
    from course_lib.bench.ceilings import measure_ceilings

    got = measure_ceilings(0.2)
    assert got["h2d_GBps"] and got["d2h_GBps"] and got["d2d_GBps"]
