"""Helpers the runtime tests share: functions defined the way a notebook defines them, and processes checked by pid."""

from __future__ import annotations

import itertools
import linecache
import os
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_CELLS = itertools.count(1)


def notebook_function(src: str, name: str, **globals_):
    """Define a function in a fake __main__, as a notebook cell does (cloudpickle must send it by value)."""
    src = textwrap.dedent(src)
    filename = f"<notebook cell {next(_CELLS)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # as IPython does for cells
    ns = {"__name__": "__main__", **globals_}
    exec(compile(src, filename, "exec"), ns)
    return ns[name]


def process_state(pid: int) -> str | None:
    """The process's state letter from /proc ("Z" for a zombie), or None when no process has this pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # it exists, owned by someone else
    try:
        # The command name in parentheses may itself hold spaces or ")"; the state follows the last ") ".
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return None


def gone(pid: int, zombie_ok: bool = False) -> bool:
    """No process has this pid (with zombie_ok: or only an exited one that its new parent has not reaped yet)."""
    state = process_state(pid)
    return state is None or (zombie_ok and state == "Z")


def wait_gone(pids, within: float = 10.0, zombie_ok: bool = False) -> list[int]:
    """The pids still alive after waiting up to ``within`` seconds for all of them to end."""
    end = time.monotonic() + within
    while time.monotonic() < end and not all(gone(p, zombie_ok) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not gone(p, zombie_ok)]


def assert_all_gone(pids, within: float = 5.0) -> None:
    # A zombie still answers kill(0); it is dead for our purpose only once reaped.
    assert wait_gone(pids, within) == [], "rank processes left running"


def pids_in(folder: Path, n: int, wait: float = 30.0) -> list[int]:
    """The pids that ``n`` ranks wrote into ``folder`` (one file per rank), waiting for them to start."""
    end = time.monotonic() + wait
    while time.monotonic() < end:
        files = list(folder.iterdir())
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in sorted(files)]
        time.sleep(0.05)
    raise AssertionError(f"only {len(list(folder.iterdir()))} of {n} ranks started")


@pytest.fixture
def spawned(monkeypatch):
    """The pids the rank server forked during the test (the OS then tells whether they are gone)."""
    from course_lib.runtime.forkserver import ForkServer

    pids, spawn = [], ForkServer.spawn

    def recording(self, payload, fds):
        pids.append(spawn(self, payload, fds))
        return pids[-1]

    monkeypatch.setattr(ForkServer, "spawn", recording)
    return pids


@pytest.fixture
def warm_server():
    """The rank server already running, so a test's wall-clock bound measures the launch, not torch's import."""
    from course_lib.runtime.forkserver import get_server

    return get_server()


@pytest.fixture
def cuda_initialised_in_kernel(monkeypatch):
    """The kernel's torch as after a learner's ``torch.zeros(1, device="cuda")``: torch.cuda marked initialised.

    A rank forked from this process would inherit the mark (and on a GPU machine fail with "Cannot re-initialize
    CUDA in forked subprocess"); a rank forked from the rank server must not.
    """
    import torch

    monkeypatch.setattr(torch.cuda, "_initialized", True)


_SOLUTION_LINES: list = []


def solution_lines() -> set:
    """Every line of 16 characters or more inside the worked notebooks' ### BEGIN/END SOLUTION regions."""
    if not _SOLUTION_LINES:
        import json

        from course_lib.classroom.student import BEGIN, END

        lines = set()
        for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
            for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
                src = "".join(cell["source"])
                if cell["cell_type"] == "code" and BEGIN in src:
                    inside = src.split(BEGIN, 1)[1].split(END, 1)[0]
                    lines |= {ln.strip() for ln in inside.splitlines() if len(ln.strip()) >= 16}
        _SOLUTION_LINES.append(lines)
    return _SOLUTION_LINES[0]


@pytest.fixture(autouse=True)
def no_checker_message_hands_over_a_solution(monkeypatch):
    """Every wrong answer a test feeds a checker is answered without a line of the worked solution: each
    ExerciseFailed raised while a test runs is read here."""
    from course_lib.checks import core

    made = core.ExerciseFailed.__init__

    def read(self, message=""):
        made(self, message)
        lines = str(self).split("\n")
        # the learner's own traceback may show their own line, which can equal the solution's: that is no leak
        said = "\n".join(line for i, line in enumerate(lines) if not (i and lines[i - 1].lstrip().startswith('File "')))
        leaked = sorted(line for line in solution_lines() if line in said)
        assert not leaked, f"a checker's message holds lines of a worked solution: {leaked}"

    monkeypatch.setattr(core.ExerciseFailed, "__init__", read)

