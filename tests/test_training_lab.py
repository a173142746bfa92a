"""The training lab under real torchrun (--standalone, CPU, gloo): every arch runs, every rank reports, and the
synchronous runs end with the single-process weights (the lab's own check, exit code 0)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("arch,extra", [("ps", []), ("allreduce", ["--collective", "ring"]), ("ddp", [])])
def test_torchrun_lab(arch, extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.labs.train", "--arch", arch, "--steps", "4", "--hidden", "64", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert f"[rank 0/2] arch={arch}" in out.stdout and f"[rank 1/2] arch={arch}" in out.stdout
    assert "(EQUAL)" in out.stdout
    if arch == "ps":
        assert "role=server" in out.stdout and "role=worker" in out.stdout
