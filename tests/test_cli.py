"""`python -m course_lib doctor` and `bench launch` as a learner or lab admin runs them."""

import io
import json
import os
import subprocess
import sys

from course_lib.classroom import doctor
from tests.conftest import ROOT


def cli(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "course_lib", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_doctor_reports_the_machine_and_passes_its_smoke_test():
    done = cli("doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for needle in ("platform", "torch", "backends      gloo yes", "cpu cores", "GPUs", "auto, 4 ranks",
                   "runs here     gloo lessons (every notebook): yes, up to", "smoke test    OK"):
        assert needle in out, needle
    assert str(ROOT) not in out  # the interpreter is shown relative to the folder it was started in


def test_doctor_fails_with_a_reason_when_the_smoke_test_cannot_run():
    done = cli("doctor", "--backend", "nccl", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1
    assert "smoke test    not run: NCCL needs one CUDA GPU per rank" in done.stdout


def test_doctor_says_what_runs_on_free_notebook_gpus(monkeypatch):
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    kaggle = doctor.what_runs_here(gpus=2, most_ranks=100)  # Kaggle's 2 x T4
    assert kaggle == ["gloo lessons (every notebook): yes, up to 100 ranks by memory and open files",
                      "NCCL lessons: up to 2 ranks, one GPU each (the 2-rank NCCL cells run here)",
                      "notebook host: Kaggle"]
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE")
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab")
    colab = doctor.what_runs_here(gpus=1, most_ranks=None)  # Colab's one GPU
    assert colab[1] == "NCCL lessons: 1 rank only (one GPU per rank); multi-rank cells use gloo on the CPU"
    assert colab[2] == "notebook host: Google Colab"


def test_doctor_on_windows_points_to_wsl2(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    out = io.StringIO()
    assert doctor.report(out=out) is False
    assert "Native Windows cannot run the ranks" in out.getvalue() and "inside WSL2" in out.getvalue()


def test_bench_launch_prints_its_tables(tmp_path):
    done = cli("bench", "launch", "--ranks", "2", "--reps", "3", "--spawn-reps", "1", "--result-mb", "1",
               "--launches", "5", "--json", str(tmp_path / "launch.json"), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "course_lib.run (warm)" in done.stdout and "mp.spawn" in done.stdout and "memcpy MB/s" in done.stdout
    figures = json.loads((tmp_path / "launch.json").read_text())
    assert figures["run"]["2"]["median"] > 0 and figures["spawn"]["2"]["median"] > 0
    row = figures["results"][0]
    assert row["mb_per_rank"] == 1 and (row["MBps"] is None or row["MBps"] > 0) and row["memcpy_MBps"] > 0
    assert figures["back_to_back"]["launches"] == 5 and figures["back_to_back"]["left_running"] == 0
    assert figures["training_rank_private_MiB"] > 0


def test_doctor_says_whether_a_cjk_font_shows_the_chinese_terms(monkeypatch):
    """With fc-list: its families for :lang=zh name the font; with none, the line says how to get one."""
    import subprocess

    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/usr/bin/fc-list")
    found = subprocess.CompletedProcess([], 0, stdout="Noto Sans CJK SC,Noto Sans CJK SC Regular\nAR PL UMing\n")
    monkeypatch.setattr(doctor.subprocess, "run", lambda *a, **k: found)
    assert doctor.font_line().split(None, 2)[2] == "AR PL UMing (+1 more): the notebooks' Chinese terms show"
    monkeypatch.setattr(doctor.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess([], 0, stdout=""))
    line = doctor.font_line()
    assert "none" in line and "sudo apt install fonts-noto-cjk" in line
