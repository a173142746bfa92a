"""Notebook 11's lab under real torchrun (--standalone, 2 processes, CPU, gloo): every arch runs in one job, every
rank reports, and each arch's final weights equal its single-process reference within what rounding allows (the lab's
own check, exit code 0; float64 so that DiLoCo's and PowerSGD's bounds decide too)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("gossip", "localsgd", "diloco", "powersgd")


@pytest.mark.timeout(180)
def test_torchrun_decentralized_lab_runs_every_arch():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.labs.decentralized", "--arch", *ARCHS, "--steps", "4", "--H", "2", "--hidden", "32",
           "--dtype", "float64"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    for arch in ARCHS:
        assert f"[rank 0/2] arch={arch}" in out.stdout and f"[rank 1/2] arch={arch}" in out.stdout, text[-3000:]
        assert f"{arch}: every rank's final weights" in out.stdout and "(DIFFERENT)" not in out.stdout
    assert out.stdout.count("(EQUAL)") == len(ARCHS) and "cannot tell" not in out.stdout
