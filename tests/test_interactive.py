"""Persistent interactive ranks (course_lib.runtime.interactive): state between cells, output order, failures, restarts,
interrupts and shutdown leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from course_lib.runtime import ranks_magic as magic
from course_lib.runtime.interactive import CellFailed, Ranks
from course_lib.runtime.protocol import CELL_SLACK_S
from tests.conftest import ROOT, wait_gone


@pytest.fixture(scope="module")
def four():
    group = Ranks(4, timeout=10).start()
    yield group
    group.stop()


def test_variables_persist_across_cells(four):
    four.run_cell("t = torch.tensor([rank + 1.0])", show=False)
    four.run_cell("dist.all_reduce(t)", show=False)
    res = four.run_cell("t * 2", show=False)
    assert res.values == {r: "tensor([20.])" for r in range(4)}
    assert [v.item() for v in four.pull("t")] == [10.0] * 4
    assert four.pull("world_size") == [4] * 4 and four.pull("rank") == [0, 1, 2, 3]


def test_output_arrives_in_rank_order(four, capsys):
    # The last rank prints first and rank 0 last, yet the cell shows rank 0's lines first.
    res = four.run_cell("import time\ntime.sleep(0.05 * (world_size - rank))\nprint('hello from', rank)\n"
                        "print('second line', rank)\nrank")
    out = capsys.readouterr().out.splitlines()
    expected = []
    for r in range(4):
        expected += [f"[rank {r}] hello from {r}", f"[rank {r}] second line {r}", f"[rank {r}] Out: {r}"]
    assert out == expected
    assert res.stdout[3] == "hello from 3\nsecond line 3\n"


def test_subset_of_ranks_and_pull(four):
    res = four.run_cell("y = 10 * rank\nprint('ran on', rank)", ranks=[0, 2], show=False)
    assert sorted(res.stdout) == [0, 2]
    assert four.pull("y", ranks=[0, 2]) == [0, 20]
    with pytest.raises(KeyError, match="rank 1 has no variable 'y'"):
        four.pull("y")
    with pytest.raises(ValueError):
        four.run_cell("pass", ranks=[7])


def test_figure_comes_back_from_the_rank_that_draws(four):
    res = four.run_cell("if rank == 1:\n    import matplotlib.pyplot as plt\n    plt.plot([0, rank])", show=False)
    assert [len(res.figures[r]) for r in range(4)] == [0, 1, 0, 0]
    assert res.figures[1][0].startswith(b"\x89PNG")


def test_failing_rank_is_named_and_waiting_peers_are_released_within_the_timeout(capsys):
    with Ranks(3, timeout=3) as group:
        group.run_cell("t = torch.ones(2)", show=False)
        t0 = time.monotonic()
        with pytest.raises(CellFailed) as info:
            group.run_cell("if rank == 1:\n    raise ValueError('boom on one rank')\ndist.all_reduce(t)")
        waited = time.monotonic() - t0
        assert "[course_lib] rank 1 failed; ranks 0 and 2 are still running." in capsys.readouterr().err
        err = info.value
        assert err.rank == 1 and err.failure.etype == "ValueError"
        assert type(err).__name__ == "ValueError"  # the cell shows the rank's exception type, like a local cell
        assert "rank 1 raised ValueError: boom on one rank" in str(err)
        assert "raise ValueError('boom on one rank')" in str(err)  # the cell's own line, from the rank
        # Ranks 0 and 2 waited in all_reduce for rank 1; the 3 s timeout released them (not gloo's 30 min).
        assert sorted(o.rank for o in err.others) == [0, 2]
        assert all("Timed out" in o.message for o in err.others)
        assert waited < 3 + CELL_SLACK_S  # released by the collective timeout, before the group's own deadline
        # Their collectives timed out: gloo closed those connections, so the group is marked broken, and says so.
        assert "ranks 0 and 2 gave up waiting in a collective" in repr(group) and "broken" in repr(group)
        assert "The group is marked broken: %ranks restart (or .restart()) starts a fresh group" in str(err)
        pids = group.pids
        with pytest.raises(RuntimeError, match=r"the group cannot run cells \(ranks 0 and 2 gave up waiting"):
            group.run_cell("print('never runs')")
        assert group.pids == pids  # refused in the kernel, before any rank was asked
        group.restart()
        assert group.run_cell("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()", show=False).values[2] == "3.0"


def test_a_deadlocked_cell_names_the_rank_that_never_called_and_breaks_the_group():
    with Ranks(2, timeout=2) as group:
        with pytest.raises(CellFailed) as info:  # rank 0 receives; rank 1 never sends and finishes the cell
            group.run_cell("t = torch.zeros(1)\nif rank == 0:\n    dist.recv(t, src=1)", show=False)
        text = str(info.value)
        assert text.startswith("rank 0 timed out after 2 s waiting in dist.recv: the peer it waited for never")
        assert "Rank 1 had finished the cell." in text
        assert "Look at rank 1, which had already finished the cell: it did not call the matching operation." in text
        with pytest.raises(RuntimeError, match="rank 0 gave up waiting in a collective.*%ranks restart"):
            group.run_cell("t")
        group.broken = ""  # why the group is marked broken: gloo closed the pair that timed out
        with pytest.raises(CellFailed, match="Application timeout caused pair closure"):
            group.run_cell("dist.all_reduce(torch.ones(1))", show=False)


def test_the_kernels_cuda_state_never_reaches_a_persistent_rank(cuda_initialised_in_kernel):
    with Ranks(2, timeout=10) as group:
        assert group.run_cell("torch.cuda._initialized", show=False).values == {0: "False", 1: "False"}


def test_a_dead_rank_breaks_the_group_until_restart():
    with Ranks(2, timeout=5) as group:
        with pytest.raises(CellFailed) as info:
            group.run_cell("import os\nif rank == 1:\n    os._exit(3)", show=False)
        assert info.value.rank == 1 and "code 3" in str(info.value)
        with pytest.raises(RuntimeError, match="restart"):
            group.run_cell("pass")
        group.restart()
        assert group.run_cell("rank", show=False).values == {0: "0", 1: "1"}


def test_a_rank_whose_process_ends_between_cells_is_named_at_the_next_cell():
    # NCCL's watchdog ends a process at a collective's timeout whether a cell is running or not (notebook 05b)
    with Ranks(2, timeout=5) as group:
        group.run_cell("x = 1", show=False)
        os.kill(group.pids[0], signal.SIGABRT)
        deadline = time.monotonic() + 10
        while "broken" not in repr(group) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "rank 0's process has ended" in repr(group)
        with pytest.raises(CellFailed) as info:                      # not a BrokenPipeError from the socket
            group.run_cell("x", show=False)
        assert info.value.rank == 0 and "SIGABRT" in str(info.value)
        with pytest.raises(RuntimeError, match="restart"):
            group.run_cell("pass")


def test_restart_ten_times_in_a_row():
    group = Ranks(2, timeout=10).start()
    try:
        seen = []
        for i in range(10):
            old = group.pids
            group.restart()
            assert wait_gone(old) == []
            seen += group.pids
            res = group.run_cell(f"t = torch.tensor([{i} + rank])\ndist.all_reduce(t)\nt.item()", show=False)
            assert res.values == {0: str(2 * i + 1), 1: str(2 * i + 1)}
        assert len(set(seen)) == 20
    finally:
        group.stop()
    assert wait_gone(seen) == []


def test_magic_commands(capsys):
    magic.ranks_magic("start 2 --timeout 10")
    try:
        group = magic.current()
        magic.ranks_magic("", "a = torch.full((2,), float(rank))")
        magic.ranks_magic("0", "a += 5")
        got = magic.ranks_magic("pull a")
        assert [v.tolist() for v in got] == [[5.0, 5.0], [1.0, 1.0]]
        assert torch.equal(magic.ranks_magic("pull a 1")[0], torch.ones(2))
        pids = group.pids
        magic.ranks_magic("restart")
        assert wait_gone(pids) == []
        with pytest.raises(CellFailed, match="NameError"):
            magic.ranks_magic("", "a")  # a new group starts with empty namespaces
        capsys.readouterr()
        assert magic.ranks_magic("1 --catch", "a") is None  # --catch shows the failure and does not raise
        shown = capsys.readouterr().err
        assert "rank 1 raised NameError: name 'a' is not defined" in shown and "Traceback of rank 1" in shown
        assert "status" not in shown and "ready" in repr(magic.ranks_magic("status"))  # the group goes on
    finally:
        pids = magic.current().pids
        magic.ranks_magic("stop")
    assert wait_gone(pids) == []


KERNEL = textwrap.dedent("""
    import sys
    from course_lib.runtime.forkserver import get_server
    from course_lib.runtime.interactive import Ranks
    group = Ranks(2, timeout=60).start()
    print("PIDS", *group.pids, get_server().proc.pid, flush=True)
    group.run_cell("x = 41 + rank", show=False)
    if sys.argv[1] == "kill":
        print("BUSY", flush=True)
        group.run_cell("import time; time.sleep(120)", show=False)
    for code, ranks in (("import time; time.sleep(120)", None), ("dist.all_reduce(torch.ones(1))", [0])):
        print("BUSY", flush=True)  # the test now sends SIGINT, as Jupyter's stop button does
        try:
            group.run_cell(code, ranks, show=False)
        except KeyboardInterrupt:
            pass
        print("AFTER", *group.pids, group.run_cell("'x' in globals()", show=False).values[1], flush=True)
""")


def _kernel(mode: str):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", KERNEL, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    first = proc.stdout.readline().split()
    assert first and first[0] == "PIDS", proc.stderr.read()
    return proc, [int(p) for p in first[1:]]


def test_interrupt_reaches_ranks_and_exit_leaves_no_process():
    proc, pids = _kernel("interrupt")
    try:
        ranks = pids[:2]
        assert proc.stdout.readline().strip() == "BUSY"
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        # Ranks in Python code get KeyboardInterrupt and keep their variables (same pids, x still defined).
        assert proc.stdout.readline().split() == ["AFTER", *map(str, ranks), "True"]
        assert proc.stdout.readline().strip() == "BUSY"
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        # Rank 0 alone in all_reduce is blocked in C++: after the grace the group is restarted, namespaces empty.
        after = proc.stdout.readline().split()
        assert after[0] == "AFTER" and after[-1] == "False"
        new = [int(p) for p in after[1:-1]]
        assert not set(new) & set(ranks) and wait_gone(ranks) == []
        assert proc.wait(30) == 0
        assert "stayed blocked inside C++" in proc.stderr.read()
        assert wait_gone(new) == []  # a normal exit stops the group (atexit)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_kernel_leaves_no_process():
    proc, pids = _kernel("kill")
    assert proc.stdout.readline().strip() == "BUSY"
    proc.kill()  # no atexit: the rank server sees its socket close, and the ranks their lifeline
    proc.wait()
    # The orphans are reparented; a container's init may be slow to reap them, so an exited zombie counts as gone.
    assert wait_gone(pids, zombie_ok=True) == []
