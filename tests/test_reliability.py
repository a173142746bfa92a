"""Failures, hangs and interrupts: the first failing rank is named, every rank is ended, nothing is left behind."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

import pytest

from course_lib import RankFailed, RankTimeout, run
from course_lib.runtime.protocol import KILL_WAIT_S, STOP_GRACE_S, TERM_TO_KILL_S, WATCH_SLACK_S
from course_lib.runtime.rank_failure import FailureRecord, names
from tests.conftest import ROOT, assert_all_gone, notebook_function, pids_in

# The longest a launch may take to end once its ranks run: the deadline, the grace, then SIGTERM and SIGKILL.
STOPPED_WITHIN = WATCH_SLACK_S + STOP_GRACE_S + TERM_TO_KILL_S + KILL_WAIT_S

# Every rank records its pid first, so a test can check afterwards that none is left running.
PIDS = """
import os, time, signal, torch, torch.distributed as dist
def record_pid(folder):
    with open(os.path.join(folder, str(dist.get_rank())), "w") as f:
        f.write(str(os.getpid()))
"""


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
        run(f, 4, timeout=30, output="none")
    assert time.monotonic() - t0 < 30  # the peers were stopped, not released by their 30 s collective timeout
    exc = err.value
    assert exc.rank == 2 and exc.failure.etype == "ValueError"
    text = str(exc)
    assert text.startswith("rank 2 raised ValueError: bad value on purpose")
    assert "Traceback of rank 2" in text and 'raise ValueError("bad value on purpose")' in text
    assert len(spawned) == 4
    assert_all_gone(spawned)
    # The peers' "Connection closed by peer" comes without gloo's source path and is not cut inside a word.
    reported = text.split("Other ranks then reported (consequences of the first failure):\n")[1].splitlines()
    assert sorted(line.split(":")[0].strip() for line in reported) == ["rank 0", "rank 1", "rank 3"]
    for line in reported:
        assert "Connection closed by peer" in line or "Connection reset by peer" in line, line
        assert ".cc:" not in line and "third_party" not in line and line.endswith((".", " ...")), line


def test_the_launchers_own_frames_are_hidden():
    f = fn("def work():\n    raise KeyError('mine')\n", "work")
    with pytest.raises(RankFailed) as err:
        run(f, 2, output="none")
    frames = traceback.extract_tb(err.value.__traceback__)
    launcher = [fr.name for fr in frames if fr.filename.endswith(os.path.join("runtime", "launch.py"))]
    assert launcher == ["run"]  # the call the learner wrote, nothing below it
    shown = err.value._render_traceback_()  # what IPython prints instead of a kernel-side traceback
    assert shown[0] == "RankFailed: rank 0 raised KeyError: 'mine'" or shown[0].startswith("RankFailed: rank 1")
    assert not any("course_lib" in line for line in shown), shown


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


def test_a_segfault_shows_its_stderr_or_says_there_was_none():
    f = fn(
        """
        def work(say):
            if dist.get_rank() == 1:
                if say:
                    os.write(2, b"native code: bad pointer\\n")
                os.kill(os.getpid(), signal.SIGSEGV)
            dist.barrier()
        """,
        "work",
    )
    with pytest.raises(RankFailed) as err:
        run(f, 2, args=(True,), output="none")
    assert str(err.value).startswith("rank 1 was killed by SIGSEGV (11), a crash inside C++ code: its last lines on "
                                     "stderr are below")
    assert "Last lines rank 1 wrote to stderr:\nnative code: bad pointer" in str(err.value)
    quiet = FailureRecord(1, "signal", "", 0.0, exitcode=-signal.SIGSEGV)
    assert quiet.headline() == ("rank 1 was killed by SIGSEGV (11), a crash inside C++ code; it wrote nothing to "
                                "stderr before it died")


def test_ranks_are_named_in_grammatical_sentences():
    assert [names(r) for r in ([3], [2, 3], [0, 1, 2])] == ["rank 3", "ranks 2 and 3", "ranks 0, 1 and 2"]
    one = RankTimeout(2, [3], [0, 1, 2], {})
    assert str(one).startswith("rank 3 had not finished after 2 s (timeout=2); ranks 0, 1 and 2 had. It was stopped.")
    two = RankTimeout(2, [2, 3], [], {})
    assert str(two).startswith("ranks 2 and 3 had not finished after 2 s (timeout=2); no rank had. They were")


def test_a_hang_outside_collectives_ends_at_the_timeout_naming_the_ranks(warm_server):
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
    assert time.monotonic() - t0 < 2 + STOPPED_WITHIN
    assert err.value.unfinished == [1] and err.value.finished == [0]
    # the time it really ran (rank 0's end-of-run wait timed out first), then where the late rank was
    assert re.match(r"rank 1 had not finished after [\d.]+ s \(timeout=2\); rank 0 had\. It was stopped\.",
                    str(err.value))
    assert "rank 1: `time.sleep(600)` at " in str(err.value)
    assert "rank 0: had returned from the function and waited for the others" in str(err.value)
    assert "about to sleep" in str(err.value)


def test_a_rank_waiting_in_a_collective_is_released_by_the_timeout(warm_server):
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
    assert time.monotonic() - t0 < 2 + STOPPED_WITHIN
    assert not isinstance(err.value, RankTimeout)  # gloo's own timeout fired, inside the launch's deadline
    text = str(err.value)
    assert err.value.rank in (1, 2) and "Timed out" in err.value.failure.message
    # Said as a timeout in the call it waited in, not as "your function failed"; the hint names the late rank.
    assert text.startswith(f"rank {err.value.rank} timed out after 2 s waiting in dist.all_reduce: ")
    assert 0 in err.value.still_running
    # The traceback ends at the learner's line; torch's own frames below it are summed up, not listed with paths.
    summed = r"\n  \.\.\. then \d+ frames? inside torch, down to all_reduce\(\) in distributed_c10d\.py\n"
    assert re.search(summed, text)
    assert "site-packages" not in text and "c10d_logger" not in text
    assert "distributed_c10d.py" in err.value.failure.traceback  # all of it is still kept
    # Rank 0 never came; the other waiting rank may still have been running too when the first one gave up.
    other = 3 - err.value.rank
    alone = "Look at rank 0, which was still running: it did not call the matching operation."
    both = f"Look at ranks 0 and {other}, still running then: one of them did not call the matching operation."
    assert "Hint: This rank waited in a collective or recv for a peer that never came within the timeout." in text
    assert alone in text or both in text


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
        run(fn(MISMATCHES[kind], "work"), 3, check_collectives=True, timeout=30, output="none")
    assert time.monotonic() - t0 < 30  # said at once by every rank, not found by the 30 s collective timeout
    reported = [err.value.failure, *err.value.others]
    mismatch_ranks = sorted(f.rank for f in reported if "Detected mismatch between collectives" in f.message)
    assert mismatch_ranks == [0, 1, 2], [(f.rank, f.message[:80]) for f in reported]
    assert "Hint: The ranks called different collectives" in str(err.value)


def test_without_teaching_mode_a_shape_mismatch_passes_silently():
    # Why the teaching mode exists: gloo only compares element counts.
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
from course_lib.runtime import forkserver as _forkserver
{pids}
def work(folder, in_collective):
    record_pid(folder)
    if in_collective and dist.get_rank() == 0:
        t = torch.zeros(1); dist.recv(t, src=1)   # blocked inside C++: ignores SIGINT
    time.sleep(600)
course_lib.run(lambda: None, 2, output="none")     # start the server
print("server", _forkserver._server.proc.pid, flush=True)
for folder, in_collective in {phases!r}:
    try:
        course_lib.run(work, 3, args=(folder, in_collective), timeout=300)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


def start_kernel(tmp_path: Path, in_collective: list[bool]):
    """A kernel that runs 3 ranks once per entry of ``in_collective``; returns it, its server and the pid folders."""
    folders = [tmp_path / f"pids{i}" for i in range(len(in_collective))]
    for folder in folders:
        folder.mkdir()
    phases = [(str(f), c) for f, c in zip(folders, in_collective)]
    script = KERNEL.format(root=str(ROOT), pids=PIDS, phases=phases)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server = int(proc.stdout.readline().split()[1])
    return proc, server, folders


def test_interrupting_the_cell_leaves_no_rank_process(tmp_path):
    # One kernel, interrupted twice: ranks busy in Python, then rank 0 blocked inside a C++ recv.
    proc, server, folders = start_kernel(tmp_path, [False, True])
    for folder in folders:
        pids = pids_in(folder, 3)
        assert [os.getpgid(p) for p in pids] == pids  # each rank leads its own process group (it and its children)
        proc.send_signal(signal.SIGINT)  # what Jupyter's stop button does to the kernel
        assert proc.stdout.readline().strip() == "interrupted"
        assert_all_gone(pids)
    proc.communicate(timeout=20)
    assert_all_gone([server])  # the kernel process ended, so its rank server ended too


def test_a_killed_kernel_takes_its_ranks_with_it(tmp_path):
    proc, server, folders = start_kernel(tmp_path, [True])
    pids = pids_in(folders[0], 3)
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
