"""The 05b checkers against the methods the review tried: a side channel, chunks, a second call, and the learner's
state given back afterwards (course_lib/checks/cell_by_cell.py; the main cases are in test_checks_training.py)."""

import pytest

from course_lib.checks.cell_by_cell import check_accumulate, check_newest, check_sync
from course_lib.checks.core import ExerciseFailed
from course_lib.runtime.interactive import Ranks

CELLS = '''
calls = 0

def newest_by_store():          # right numbers, wrong method: the versions meet in the group's store, no collective
    global calls
    calls += 1
    store = dist.distributed_c10d._get_default_store()
    store.set(f"v{calls}_{rank}", str(version))
    vs = [int(store.get(f"v{calls}_{r}")) for r in range(world_size)]
    return vs.index(max(vs))

def newest_one_hot():           # written differently: one slot per rank, then the highest
    slots = torch.full((world_size,), -1, dtype=torch.long, device=device)
    slots[rank] = version
    dist.all_reduce(slots, op=dist.ReduceOp.MAX)
    return int(slots.argmax())

def sync_in_chunks():           # right numbers, wrong method: w summed in four chunks, plus a dummy broadcast of w
    global version
    src = newest()
    for part in w.chunk(4):
        mine = part.clone() if rank == src else torch.zeros_like(part)
        dist.all_reduce(mine)
        part.copy_(mine)
    dist.broadcast(torch.zeros_like(w), src=0)
    v = torch.tensor([version], device=device)
    dist.broadcast(v, src=src)
    version = int(v.item())

def sync_float64():             # correct, but w travels in float64: twice its float32 bytes
    global w, version
    packed = torch.cat([w.double(), torch.tensor([float(version)], dtype=torch.float64, device=device)])
    dist.broadcast(packed, newest())
    w, version = packed[:-1].float(), int(packed[-1].item())

def step_in_two_calls():        # the sum and the count in two all-reduces
    global acc, seen
    n = torch.tensor([float(seen)], device=device)
    dist.all_reduce(acc)
    dist.all_reduce(n)
    mean = acc / n
    acc, seen = None, 0
    return mean

def step_by_store():            # the gradient through the store, a 4-byte all-reduce beside it
    global acc, seen
    store = dist.distributed_c10d._get_default_store()
    store.set(f"g{rank}", ",".join(map(str, (acc / seen).tolist())))
    dist.all_reduce(torch.zeros(1, device=device))
    parts = [torch.tensor([float(x) for x in store.get(f"g{r}").decode().split(",")]) for r in range(world_size)]
    acc, seen = None, 0
    return sum(parts) / world_size
'''


def test_side_channels_chunks_and_extra_calls_are_refused_and_the_state_is_given_back(capsys):
    with Ranks(4, timeout=10) as ranks:
        ranks.run_cell(CELLS + "w = torch.zeros(4, device=device)\nversion = 7 if rank == 2 else 0", show=False)
        ranks.run_cell("newest = newest_by_store", show=False)
        with pytest.raises(ExerciseFailed, match=r"newest\(\) ran \[\] .*with at least one"):
            check_newest(ranks)
        ranks.run_cell("newest = newest_one_hot", show=False)
        check_newest(ranks)
        # the check set its own w and version on every rank, then gave the learner's back
        assert ranks.run_cell("(version, w.tolist())", show=False).values[2] == "(7, [0.0, 0.0, 0.0, 0.0])"
        ranks.run_cell("sync = sync_in_chunks", show=False)
        with pytest.raises(ExerciseFailed, match=r"all-reduces may carry under 1000 bytes in all"):
            check_sync(ranks)
        ranks.run_cell("sync = sync_float64", show=False)
        with pytest.raises(ExerciseFailed, match=r"one broadcast of under 8000 bytes"):
            check_sync(ranks)
        ranks.run_cell(
            "acc, seen = None, 0\n"
            "def accumulate(g):\n    global acc, seen\n    acc = g.clone() if acc is None else acc + g\n    seen += 1\n"
            "step = step_in_two_calls", show=False)
        with pytest.raises(ExerciseFailed, match=r"one all_reduce \(pack a count into it"):
            check_accumulate(ranks)
        ranks.run_cell("acc, seen = None, 0\nstep = step_by_store", show=False)
        with pytest.raises(ExerciseFailed, match=r"less than one gradient's 12"):
            check_accumulate(ranks)
        # a correct step, checked after an accumulate cell of the lesson's own (another shape): the check starts
        # from the exercise cell's state, then gives the learner's back
        ranks.run_cell(
            "def step():\n    global acc, seen\n    mean = acc / (seen * world_size)\n    dist.all_reduce(mean)\n"
            "    acc, seen = None, 0\n    return mean\n"
            "accumulate(torch.ones(2, device=device))", show=False)
        check_accumulate(ranks)
        assert ranks.run_cell("(acc.tolist(), seen)", show=False).values[0] == "([1.0, 1.0], 1)"
    assert "passed" in capsys.readouterr().out
