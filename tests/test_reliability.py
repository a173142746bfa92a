"""Failures, hangs and interrupts: the first failing rank is named, every rank is ended, nothing is left behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from course_lib import RankFailed, RankTimeout, run
from tests.test_launch import notebook_function

ROOT = Path(__file__).resolve().parents[1]

# Every rank records its pid first, so a test can check afterwards that none is left running.
PIDS = """
import os, time, signal, torch, torch.distributed as dist
def record_pid(folder):
    with open(os.path.join(folder, str(dist.get_rank())), "w") as f:
        f.write(str(os.getpid()))
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose only once reaped, so check its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def pids_in(folder: Path, n: int, wait: float = 30.0) -> list[int]:
    end = time.monotonic() + wait
    while time.monotonic() < end:
        files = list(folder.iterdir())
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in sorted(files)]
        time.sleep(0.05)
    raise AssertionError(f"only {len(list(folder.iterdir()))} of {n} ranks started")


def assert_all_gone(pids: list[int], within: float = 5.0) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "rank processes left running"


@pytest.fixture
def spawned(monkeypatch):
    """The pids the rank server forked during the test (the OS then tells whether they are gone)."""
    from course_lib._forkserver import ForkServer

    pids, spawn = [], ForkServer.spawn

    def recording(self, payload, fds):
        pids.append(spawn(self, payload, fds))
        return pids[-1]

    monkeypatch.setattr(ForkServer, "spawn", recording)
    return pids


def fn(src: str, name: str):
    return notebook_function(PIDS + textwrap.dedent(src), name)


def test_a_rank_that_raises_is_named_with_its_traceback_and_all_ranks_end(spawned):
    f = fn(
        """
        def work():
            if dist.get_rank() == 2:
                raise ValueError("bad value on purpose")
            t = torch.ones(3)
            dist.all_reduce(t)
        """,
        "work",
    )
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as err:
        run(f, 4, output="none")
    assert time.monotonic() - t0 < 5
    exc = err.value
    assert exc.rank == 2 and exc.failure.etype == "ValueError"
    text = str(exc)
    assert text.startswith("rank 2 raised ValueError: bad value on purpose")
    assert "Traceback of rank 2" in text and 'raise ValueError("bad value on purpose")' in text
    assert len(spawned) == 4
    assert_all_gone(spawned)


def test_a_sigkilled_rank_is_reported_with_rank_and_signal(spawned):
    f = fn(
        """
        def work():
            if dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.ones(3)
            dist.all_reduce(t)
        """,
        "work",
    )
    with pytest.raises(RankFailed) as err:
        run(f, 3, output="none")
    assert err.value.rank == 1 and err.value.failure.kind == "signal"
    assert str(err.value).startswith("rank 1 was killed by SIGKILL (9)")
    assert len(spawned) == 3
    assert_all_gone(spawned)


def test_a_cpp_abort_from_a_size_mismatch_reaches_the_cell():
    f = fn(
        """
        def work():
            t = torch.ones(4 if dist.get_rank() == 0 else 5)
            dist.all_reduce(t)
        """,
        "work",
    )
    with pytest.raises(RankFailed) as err:
        run(f, 2, output="none")
    text = str(err.value)
    assert "SIGABRT" in text, text
    assert "doesn't match expected size" in text  # gloo's own words, written by C++ to fd 2


def test_a_hang_outside_collectives_ends_at_the_timeout_naming_the_ranks():
    f = fn(
        """
        def work():
            if dist.get_rank() == 1:
                print("about to sleep", flush=True)
                time.sleep(600)
        """,
        "work",
    )
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as err:
        run(f, 2, timeout=2, output="none")
    assert time.monotonic() - t0 < 2 + 5 + 5
    assert err.value.unfinished == [1] and err.value.finished == [0]
    assert "about to sleep" in str(err.value)


def test_a_rank_waiting_in_a_collective_is_released_by_the_timeout():
    f = fn(
        """
        def work():
            if dist.get_rank() == 0:
                time.sleep(600)             # never reaches the all_reduce
            dist.all_reduce(torch.ones(1))
        """,
        "work",
    )
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as err:
        run(f, 3, timeout=2, output="none")
    assert time.monotonic() - t0 < 2 + 5
    assert err.value.rank in (1, 2) and "Timed out" in str(err.value)
    assert 0 in err.value.still_running and "Hint:" in str(err.value)


MISMATCHES = {
    "op": """
        def work():
            t = torch.ones(4)
            if dist.get_rank() == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
        """,
    "shape": """
        def work():
            dist.all_reduce(torch.ones((2, 4) if dist.get_rank() == 0 else (4, 2)))
        """,
    "dtype": """
        def work():
            dist.all_reduce(torch.ones(4, dtype=torch.float32 if dist.get_rank() == 0 else torch.int32))
        """,
}


@pytest.mark.parametrize("kind", MISMATCHES)
def test_teaching_mode_turns_a_mismatch_into_an_error_on_every_rank(kind):
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as err:
        run(fn(MISMATCHES[kind], "work"), 3, check_collectives=True, output="none")
    assert time.monotonic() - t0 < 5
    reported = [err.value.failure, *err.value.others]
    mismatch_ranks = sorted(f.rank for f in reported if "Detected mismatch between collectives" in f.message)
    assert mismatch_ranks == [0, 1, 2], [(f.rank, f.message[:80]) for f in reported]
    assert "Hint: The ranks called different collectives" in str(err.value)


def test_without_teaching_mode_a_shape_mismatch_passes_silently():
    # Why the teaching mode exists (PITFALLS.md): gloo only compares element counts.
    g = fn(
        """
        def work():
            t = torch.ones((2, 4) if dist.get_rank() == 0 else (4, 2))
            dist.all_reduce(t)
            return tuple(t.shape)
        """,
        "work",
    )
    assert run(g, 2, output="none").values == [(2, 4), (4, 2)]


KERNEL = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import course_lib
from course_lib import _forkserver
{pids}
def work(folder):
    record_pid(folder)
    if {in_collective} and dist.get_rank() == 0:
        t = torch.zeros(1); dist.recv(t, src=1)   # blocked inside C++: ignores SIGINT
    time.sleep(600)
course_lib.run(lambda: None, 2, output="none")     # start the server
print("server", _forkserver._server.proc.pid, flush=True)
try:
    course_lib.run(work, 3, args=({folder!r},), timeout=300)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def start_kernel(tmp_path: Path, in_collective: bool):
    folder = tmp_path / "pids"
    folder.mkdir()
    script = KERNEL.format(root=str(ROOT), pids=PIDS, in_collective=in_collective, folder=str(folder))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server = int(proc.stdout.readline().split()[1])
    return proc, server, pids_in(folder, 3)


@pytest.mark.parametrize("in_collective", [False, True])
def test_interrupting_the_cell_leaves_no_rank_process(tmp_path, in_collective):
    proc, server, pids = start_kernel(tmp_path, in_collective)
    pgids = [os.getpgid(p) for p in pids]
    assert pgids == pids  # each rank leads its own process group, so it and its children can be ended together
    proc.send_signal(signal.SIGINT)  # what Jupyter's stop button does to the kernel
    out, _ = proc.communicate(timeout=20)
    assert "interrupted" in out
    assert_all_gone(pids)
    assert_all_gone([server])  # the kernel process ended, so its rank server ended too


def test_a_killed_kernel_takes_its_ranks_with_it(tmp_path):
    proc, server, pids = start_kernel(tmp_path, in_collective=True)
    proc.kill()  # no finally: block runs; the lifeline must do the work
    proc.wait(10)
    assert_all_gone([server, *pids], within=10)


def test_setup_failures_are_retried_then_reported(monkeypatch, capfd, spawned):
    # An interface that does not exist makes every rank fail inside init_process_group, before the function.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface0")
    with pytest.raises(RankFailed) as err:
        run(fn("def work():\n    return 1\n", "work"), 2, output="none")
    assert err.value.failure.phase == "init"
    log = capfd.readouterr().err
    assert "attempt 2 of 3" in log and "attempt 3 of 3" in log
    assert len(spawned) == 2 * 3


def test_a_failure_in_the_learners_function_is_never_retried(spawned):
    with pytest.raises(RankFailed) as err:
        run(fn("def work():\n    raise KeyError('once')\n", "work"), 2, output="none")
    assert err.value.failure.phase == "fn"
    assert len(spawned) == 2
