"""A hang shows where each rank is: the learner's line and the call it waits in, per rank (runtime/stacks.py)."""

from __future__ import annotations

import re
import time

import pytest

from course_lib import RankFailed, RankTimeout, run

from .conftest import notebook_function


def _line(fn, text: str) -> int:
    """The line of ``text`` in the cell that defined ``fn`` (as the report numbers it)."""
    import linecache

    lines = linecache.getlines(fn.__code__.co_filename)
    return next(i for i, line in enumerate(lines, 1) if text in line)


SLEEPER = notebook_function("""
import time, torch, torch.distributed as dist
def one_sleeps():
    t = torch.ones(2)
    if dist.get_rank() == 1:
        time.sleep(60)
    dist.all_reduce(t)
""", "one_sleeps")


def test_a_rank_asleep_while_the_others_all_reduce_is_shown_asleep_and_they_in_all_reduce():
    with pytest.raises(RankFailed) as info:
        run(SLEEPER, 3, timeout=3, output="none")
    text = str(info.value)
    sleep, reduce = _line(SLEEPER, "time.sleep(60)"), _line(SLEEPER, "dist.all_reduce(t)")
    assert "Where each rank was:" in text
    assert "rank 1: `time.sleep(60)` at " in text and f"line {sleep}" in text
    assert "ranks 0 and 2: dist.all_reduce at " in text and f"line {reduce}" in text


CYCLE = notebook_function("""
import torch, torch.distributed as dist
def both_send_first():
    t, r = torch.ones(2), dist.get_rank()
    dist.send(t, 1 - r)
    dist.recv(t, 1 - r)
""", "both_send_first")


def test_two_ranks_in_a_send_cycle_are_each_shown_in_their_send():
    with pytest.raises(RankFailed) as info:
        run(CYCLE, 2, timeout=3, output="none")
    text = str(info.value)
    line = _line(CYCLE, "dist.send(t, 1 - r)")
    # both time out in their send, or the second sees the first leave while still in it (its stack then says so)
    for r in (0, 1):
        assert re.search(rf"(rank {r}|ranks 0 and 1): dist\.send at .*line {line}\b", text), text


SPIN = notebook_function("""
def spin():
    x = 0
    while True:
        x += 1
""", "spin")


def test_a_hang_outside_collectives_names_the_line_and_the_real_time_it_ran():
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run(SPIN, 2, timeout=2, output="none")
    waited = time.monotonic() - t0
    text = str(info.value)
    for r in (0, 1):  # `while True:` or `x += 1`, wherever the dump caught each rank
        assert re.search(rf"(rank {r}|ranks 0 and 1): `(while True:|x \+= 1)` at ", text), text
    shown = float(text.split("had not finished after ")[1].split(" s")[0])
    assert 2 < shown <= waited  # the time it really ran, not the timeout's 2 s


RAISE_THEN_DIE = notebook_function("""
import os, signal, time, torch.distributed as dist
def raise_then_die():
    if dist.get_rank() == 0:
        raise ValueError("the first failure")
    time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGKILL)
""", "raise_then_die")


def test_a_rank_killed_by_a_signal_after_another_raised_reports_the_raise():
    # a raise is timed by the rank's wall clock, a signal by the kernel's: both on one clock now
    with pytest.raises(RankFailed) as info:
        run(RAISE_THEN_DIE, 2, timeout=20, output="none")
    assert info.value.rank == 0 and info.value.failure.etype == "ValueError"


def test_an_endless_loop_in_every_rank_of_a_ranks_cell_ends_at_its_deadline_with_a_report():
    from course_lib.runtime.cell_result import CellTimeout
    from course_lib.runtime.persistent_ranks import Ranks

    group = Ranks(2, timeout=10, cell_timeout=3).start()
    try:
        group.run_cell("x = 41")
        t0 = time.monotonic()
        with pytest.raises(CellTimeout) as info:
            group.run_cell("y = 0\nwhile True:\n    y += 1\n")
        assert time.monotonic() - t0 < 3 + 5  # the deadline, the dump and the interrupt's grace
        text = str(info.value)
        # each rank is named at a line of the loop: together when both were stopped on the same line, apart when
        # the stop found them on different lines of it (which depends on when it lands)
        lines = re.findall(r"(ranks 0 and 1|rank 0|rank 1): cell line \d+: `(while True:|y \+= 1)`", text)
        assert lines and {r for r, _ in lines} in ({"ranks 0 and 1"}, {"rank 0", "rank 1"}), text
        assert not info.value.restarted  # a Python loop stops at the interrupt: the variables stay
        assert group.pull("x") == [41, 41]
        with pytest.raises(CellTimeout, match="after 1 s"):  # a cell's own deadline (%%ranks --timeout 1)
            group.run_cell("import time\ntime.sleep(30)", timeout=1)
    finally:
        group.stop()


def test_a_ranks_cell_blocked_in_a_collective_past_its_deadline_restarts_the_group_and_says_where():
    from course_lib.runtime.cell_result import CellTimeout
    from course_lib.runtime.persistent_ranks import Ranks

    group = Ranks(2, timeout=30, cell_timeout=2).start()
    try:
        with pytest.raises(CellTimeout) as info:
            group.run_cell("t = torch.ones(2)\nif rank == 0:\n    dist.all_reduce(t)\n")
        text = str(info.value)
        assert "rank 0: dist.all_reduce at cell line 3" in text
        assert info.value.busy == [0] and info.value.restarted
        group.run_cell("z = rank")  # the restarted group works
    finally:
        group.stop()


def test_the_ranks_magic_takes_a_cells_timeout():
    from course_lib.runtime.cell_result import CellTimeout
    from course_lib.runtime.ranks_magic import ranks_magic

    ranks_magic("start 2 --timeout 10")
    try:
        with pytest.raises(CellTimeout, match=r"after 1 s \(the cell's deadline"):
            ranks_magic("--timeout 1", "import time\ntime.sleep(30)")
        with pytest.raises(ValueError, match="--timeout takes seconds"):
            ranks_magic("--timeout soon", "x = 1")
    finally:
        ranks_magic("stop")


def test_nccl_ranks_get_a_flight_recorder_whose_dump_the_report_reads(tmp_path):
    import pickle

    from course_lib.runtime.devices import Plan
    from course_lib.runtime.rank_process import payload
    from course_lib.runtime.stacks import flight_records

    nccl = Plan("nccl", ("cuda:0", "cuda:1"), "simulated")
    env = payload(nccl, 1, timeout=5, check_collectives=False, store_file=str(tmp_path / "store"))["env"]
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "flight_rank_")
    gloo = Plan("gloo", ("cpu", "cpu"), "simulated")
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in payload(gloo, 1, timeout=5, check_collectives=False,
                                                       store_file=str(tmp_path / "store"))["env"]
    # a dump in the shape torch writes (a pickled dict whose "entries" are the ring buffer's records)
    entries = [{"profiling_name": "nccl:broadcast", "collective_seq_id": 1, "state": "completed"},
               {"profiling_name": "nccl:all_reduce", "collective_seq_id": 2, "state": "scheduled"}]
    (tmp_path / "flight_rank_1").write_bytes(pickle.dumps({"version": "2.4", "entries": entries}))
    (tmp_path / "flight_rank_0").write_bytes(b"cut short")
    assert flight_records(str(tmp_path)) == {1: "nccl:all_reduce number 2, scheduled"}


def test_the_init_retry_rule():
    # retried when every failure recorded is in init and no rank began the function, whatever the number of ranks
    # that failed; never once the function started anywhere or a failure is the learner's
    from types import SimpleNamespace

    from course_lib.runtime.launch import _Launch
    from course_lib.runtime.rank_failure import FailureRecord

    def launch(failures, started=()):
        one = _Launch(None, None, 5.0, "none")
        one.ranks = [SimpleNamespace(rank=r, started=r in started) for r in range(3)]
        one.failures = failures
        return one

    init = lambda r: FailureRecord(r, "raised", "connectFullMesh failed", 0.0, etype="RuntimeError", phase="init")  # noqa: E731
    assert launch([init(1)]).setup_failed()                 # one rank's failed join is enough
    assert launch([init(0), init(1), init(2)]).setup_failed()
    assert not launch([init(1)], started={0}).setup_failed()
    assert not launch([init(1), FailureRecord(0, "raised", "x", 0.0, etype="KeyError", phase="fn")]).setup_failed()
    assert not launch([]).setup_failed()


EXTRA_BARRIER = notebook_function("""
import torch.distributed as dist
def one_extra_barrier():
    if dist.get_rank() == 0:
        dist.barrier()          # paired with rank 1's closing barrier: rank 0's own closing barrier then waits alone
""", "one_extra_barrier")


def test_every_rank_returned_but_the_closing_barrier_timed_out_is_not_called_late():
    with pytest.raises(RankFailed) as info:
        run(EXTRA_BARRIER, world_size=2, timeout=3, output="none")
    text = str(info.value)
    assert not isinstance(info.value, RankTimeout), text     # no rank was late: each had returned
    assert "had not finished" not in text and "closing barrier then failed on rank 0" in text, text
    assert "rank 0 returned from the function as did rank 1" in text, text
