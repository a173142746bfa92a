"""Ending what the course starts: a torchrun lab cell stopped with Ctrl-C, or its kernel killed, leaves nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from course_lib.labs import torchrun
from course_lib.runtime.ending import alive, end_tree

from .conftest import ROOT, wait_gone


def _pids(folder: Path, workers: int, within: float = 60.0) -> tuple[list[int], set[int]]:
    """The workers' pids and their torchrun's, once every worker has started."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        files = list(folder.glob("worker-*"))
        if len(files) == workers:
            return [int(f.name.split("-")[1]) for f in files], {int(f.read_text()) for f in files}
        time.sleep(0.1)
    raise AssertionError(f"the workers did not start within {within:.0f} s")


def test_ctrl_c_in_a_torchrun_lab_cell_ends_torchrun_and_its_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_TEST_PIDS", str(tmp_path))
    found = {}

    def press_stop():
        found["workers"], found["torchrun"] = _pids(tmp_path, 2)
        os.kill(os.getpid(), signal.SIGINT)  # what the kernel's stop button does

    presser = threading.Thread(target=press_stop, daemon=True)
    presser.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        torchrun.run("tests.torchrun_sleeper", args=(120,), nproc=2, timeout=120)
    assert time.monotonic() - t0 < 60  # at the press, not at the deadline
    pids = found["workers"] + sorted(found["torchrun"])
    assert wait_gone(pids, within=10) == [], "torchrun or a worker outlived Ctrl-C"


def test_a_killed_kernel_takes_its_torchrun_and_workers_with_it(tmp_path):
    env = {**os.environ, "COURSE_TEST_PIDS": str(tmp_path), "PYTHONPATH": str(ROOT)}
    kernel = subprocess.Popen([sys.executable, "-c", "from course_lib.labs import torchrun; "
                               "torchrun.run('tests.torchrun_sleeper', args=(120,), nproc=2, timeout=120)"],
                              env=env, cwd=ROOT, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        workers, runner = _pids(tmp_path, 2)
        kernel.kill()  # the kernel dies without any chance to clean up
        kernel.wait()
        pids = workers + sorted(runner)
        assert wait_gone(pids, within=20) == [], "torchrun or a worker outlived its kernel"
    finally:
        end_tree(kernel.pid, polite=False)


def test_end_tree_finds_children_in_sessions_of_their_own():
    # a child in a new session, as torchrun starts its workers: its parent's group alone would miss it
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                               "'-c', 'import time; time.sleep(60)'], start_new_session=True); print(flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, start_new_session=True)
    parent.stdout.readline()
    from course_lib.runtime.ending import descendants

    child = descendants(parent.pid)
    assert child and all(alive(p) for p in child)
    assert end_tree(parent.pid, grace=1.0) == []
    parent.wait()
    assert not any(alive(p) for p in child)
