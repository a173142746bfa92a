"""Checkers of notebooks 05b, 09, 12 and 13 reject the wrong solution of each kind, with its message: batches of
different sizes averaged as equal, ZeRO-1 through all-reduce, the library's tensor-parallel layer, an extra
collective; 05b's checks run on a live group of ranks. (Each right solution passes in its worked notebook, which the
notebook tests run; exercise 9.2's reducer: test_checks_reducer.py; notebook 08's: test_checks_parameter_server.py.)"""

import pytest
import torch
import torch.distributed as dist

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.sharding import check_zero1_flat_step
from course_lib.checks.tensor_parallel import check_column_parallel_forward, check_row_parallel_linear
from course_lib.checks.training import check_average_gradients


def plain_mean(model, batch_size):    # what section 1 did: right only when every batch has the same size
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def test_uneven_batches_are_weighted():
    with pytest.raises(ExerciseFailed) as e:
        check_average_gradients(plain_mean)
    assert "with 2 ranks holding [16, 12] samples" in str(e.value)
    assert "Your gradients equal the plain mean of the ranks' gradients" in str(e.value)


def zero1_by_all_reduce(params, m, v, t, lr):
    for q in params:
        dist.all_reduce(q.grad)


def test_zero1_refuses_all_reduce():
    with pytest.raises(ExerciseFailed, match=r"^Exercise 12\.2 is about replacing all-reduce by one reduce-scatter "
                                             r"and one all-gather of a flat buffer; dist\.all_reduce is switched off"):
        check_zero1_flat_step(zero1_by_all_reduce)


def column_from_the_library(x, linear):
    from course_lib.training.tensor_parallel import ColumnParallelLinear

    return ColumnParallelLinear(linear)(x)


def row_with_an_extra_gather(x, linear):
    rank, p = dist.get_rank(), dist.get_world_size()
    k = linear.in_features // p
    y = x[:, rank * k:(rank + 1) * k] @ linear.weight[:, rank * k:(rank + 1) * k].T
    parts = [torch.empty_like(y) for _ in range(p)]
    dist.all_gather(parts, y)
    return sum(parts) + linear.bias


def test_tensor_parallel_refusals():
    with pytest.raises(ExerciseFailed, match=r"training\.tensor_parallel\.ColumnParallelLinear\.__init__ \(it holds "
                                             r"the answer\) is switched off here"):       # refused as it is built
        check_column_parallel_forward(column_from_the_library)
    with pytest.raises(ExerciseFailed, match=r"Exercise 13\.2 is about one all-reduce of partial sums; "
                                             r"dist\.all_gather is switched off here"):
        check_row_parallel_linear(row_with_an_extra_gather)


CELL_BY_CELL = '''
def newest():                   # MAX of the versions, then MAX of the ranks that hold it
    top = torch.tensor([version], device=device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    who = torch.tensor([rank if version == top.item() else -1], device=device)
    dist.all_reduce(who, op=dist.ReduceOp.MAX)
    return int(who.item())

def newest_encoded():           # written differently: one MAX of version * world_size + rank
    key = torch.tensor([version * world_size + rank], device=device)
    dist.all_reduce(key, op=dist.ReduceOp.MAX)
    return int(key.item()) % world_size

def newest_by_gathering():      # the shortcut: everyone's versions
    everyone = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size)]
    dist.all_gather(everyone, torch.tensor([version], device=device))
    return int(torch.cat(everyone).argmax())

def newest_own_rank():          # a wrong result
    return rank

def sync():
    global version
    src = newest()
    dist.broadcast(w, src=src)
    v = torch.tensor([version], device=device)
    dist.broadcast(v, src=src)
    version = int(v.item())

def sync_by_sum():              # right numbers, wrong method: w summed with zeros from every other rank
    global version
    src = newest()
    mine = w if rank == src else torch.zeros_like(w)
    dist.all_reduce(mine)
    w.copy_(mine)
    version = max(version, 0) if rank == src else int(torch.tensor(0).item())
    v = torch.tensor([version], device=device)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    version = int(v.item())

acc, seen = None, 0

def accumulate(g):
    global acc, seen
    acc = g.clone() if acc is None else acc + g
    seen += 1

def step():
    global acc, seen
    total = acc / seen
    dist.all_reduce(total)
    acc, seen = None, 0
    return total / world_size

def accumulate_eagerly(g):      # right numbers, wrong method: an all-reduce for every micro-batch
    global acc, seen
    g = g.clone()
    dist.all_reduce(g)
    acc = g if acc is None else acc + g
    seen += 1

def step_eagerly():
    global acc, seen
    total = acc / seen / world_size
    acc, seen = None, 0
    dist.all_reduce(torch.zeros(1, device=device))
    return total

def step_never_reset():         # a wrong result from the second step on
    total = acc / seen
    dist.all_reduce(total)
    return total / world_size

def sync_packed():              # w and the version in one broadcast: as cheap, written differently
    global w, version
    packed = torch.cat([w, torch.tensor([float(version)], device=w.device)])
    dist.broadcast(packed, newest())
    w, version = packed[:-1].clone(), int(packed[-1].item())

grads = []

def accumulate_stacked(g):      # right numbers, wrong method: every micro-batch's gradient sent at the step
    grads.append(g.clone())

def step_stacked():
    global grads
    stacked = torch.stack(grads)
    dist.all_reduce(stacked)
    grads = []
    return stacked.mean(0) / world_size
'''


def test_cell_by_cell_checks_run_on_the_live_ranks(capsys):
    from course_lib.checks.cell_by_cell import check_accumulate, check_newest, check_sync
    from course_lib.runtime.interactive import Ranks

    with Ranks(4, timeout=10) as ranks:
        ranks.run_cell(CELL_BY_CELL, show=False)
        check_newest(ranks)
        check_sync(ranks)
        check_accumulate(ranks)
        assert capsys.readouterr().out.count("passed") == 3
        ranks.run_cell("newest = newest_encoded", show=False)
        check_newest(ranks)
        ranks.run_cell("newest = newest_by_gathering", show=False)
        with pytest.raises(ExerciseFailed, match=r"dist\.all_gather is switched off here"):
            check_newest(ranks)
        ranks.run_cell("newest = newest_own_rank", show=False)
        with pytest.raises(ExerciseFailed, match=r"rank 0's newest\(\) returned 0"):
            check_newest(ranks)
        ranks.run_cell("newest = newest_encoded\nsync = sync_by_sum", show=False)
        with pytest.raises(ExerciseFailed, match=r"must travel in exactly one broadcast"):
            check_sync(ranks)
        ranks.run_cell("sync = sync_packed", show=False)
        check_sync(ranks)
        assert capsys.readouterr().out.count("Exercise 5b.2 passed") == 1
        ranks.run_cell("accumulate, step = accumulate_stacked, step_stacked", show=False)
        with pytest.raises(ExerciseFailed, match=r"more than one gradient's 12"):
            check_accumulate(ranks)
        ranks.run_cell("accumulate, step = accumulate_eagerly, step_eagerly", show=False)
        with pytest.raises(ExerciseFailed, match=r"accumulate ran \[\('all_reduce', 12\)\]"):
            check_accumulate(ranks)
        ranks.run_cell("acc, seen = None, 0\naccumulate, step = accumulate, step_never_reset\n"
                       "def accumulate(g):\n    global acc, seen\n    acc = g.clone() if acc is None else acc + g\n"
                       "    seen += 1", show=False)
        with pytest.raises(ExerciseFailed, match=r"step 2 \(1 accumulate cell\(s\) before it\)"):
            check_accumulate(ranks)
        ranks.run_cell("def step():\n    raise NotImplementedError('Exercise 5b.3: gradients over cells: write "
                       "your solution here')", show=False)
        with pytest.raises(NotImplementedError, match=r"^Exercise 5b\.3: not attempted yet\."):
            check_accumulate(ranks)
        # the common mistake: every rank broadcasts from itself; the ranks time out, and the message says what to rerun
        ranks.run_cell("newest = newest_encoded\ndef sync():\n    dist.broadcast(w, src=rank)", show=False)
        unusable = r"(?s)Timed out waiting.*left the group unusable: run %ranks restart"
        with pytest.raises(ExerciseFailed, match=unusable) as failed:
            check_sync(ranks)
        assert "/__w/" not in str(failed.value)     # gloo's C++ source path is left out


def _zero1_padded_views(params, m, v, t, lr):      # a correct ZeRO-1 written another way: views into one buffer
    from course_lib.training.adam import adam_step

    rank, p, c = dist.get_rank(), dist.get_world_size(), m.numel()
    grads = torch.cat([q.grad.flatten() for q in params])
    grads = torch.cat([grads, grads.new_zeros(p * c - grads.numel())])
    mine = grads.new_empty(c)
    dist.reduce_scatter_single(mine, grads)
    weights = torch.cat([q.detach().flatten() for q in params])
    weights = torch.cat([weights, weights.new_zeros(p * c - weights.numel())])
    w = weights.view(p, c)[rank].clone()
    adam_step(w, mine / p, m, v, t, lr)
    dist.all_gather_single(weights, w)
    off = 0
    with torch.no_grad():
        for q in params:
            q.copy_(weights[off:off + q.numel()].view_as(q))
            off += q.numel()


_FULL_STATE = {}


def _dp_under_zero1s_name(params, m, v, t, lr):    # the right calls, but full Adam on a full state kept aside
    from course_lib.training.adam import adam_step

    p, c = dist.get_world_size(), m.numel()
    n = sum(q.numel() for q in params)
    flat = torch.zeros(p * c, device=m.device)
    flat[:n] = torch.cat([q.grad.flatten() for q in params])
    mine = torch.empty(c, device=m.device)
    dist.reduce_scatter_single(mine, flat)
    full = torch.empty(p * c, device=m.device)
    dist.all_gather_single(full, mine / p)
    state = _FULL_STATE.setdefault((dist.get_rank(), p), (torch.zeros(n), torch.zeros(n)))
    w = torch.cat([q.detach().flatten() for q in params])
    adam_step(w, full[:n], state[0], state[1], t, lr)
    torch.nn.utils.vector_to_parameters(w, params)


def test_zero1_needs_the_sharded_state():
    check_zero1_flat_step(_zero1_padded_views)
    with pytest.raises(ExerciseFailed, match="did not use this rank's shard of Adam's state"):
        check_zero1_flat_step(_dp_under_zero1s_name)
