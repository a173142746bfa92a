"""`python -m course_lib doctor` and `bench launch` as a learner or lab admin runs them."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "course_lib", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_doctor_reports_the_machine_and_passes_its_smoke_test():
    done = cli("doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for needle in ("torch", "backends      gloo yes", "cpu cores", "GPUs", "auto, 4 ranks", "smoke test    OK"):
        assert needle in out, needle


def test_doctor_fails_with_a_reason_when_the_smoke_test_cannot_run():
    done = cli("doctor", "--backend", "nccl", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1
    assert "smoke test    not run: NCCL needs one CUDA GPU per rank" in done.stdout


def test_bench_launch_prints_its_table(tmp_path):
    done = cli("bench", "launch", "--ranks", "2", "--reps", "3", "--spawn-reps", "1", "--json",
               str(tmp_path / "launch.json"), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "course_lib.run (warm)" in done.stdout and "mp.spawn" in done.stdout
    import json

    figures = json.loads((tmp_path / "launch.json").read_text())
    assert figures["run"]["2"]["median"] > 0 and figures["spawn"]["4"]["median"] > 0
