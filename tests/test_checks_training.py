"""Checkers of notebooks 05b, 08, 09, 12 and 13 reject the wrong solution of each kind, with its message: the
momentum left out, batches of different sizes averaged as equal, a bucket sent in two all-reduces, ZeRO-1 through
all-reduce, the library's tensor-parallel layer, an extra collective; 05b's checks run on a live group of ranks.
(Each right solution passes in its worked notebook, which the notebook tests run.)"""

import pytest
import torch
import torch.distributed as dist

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.sharding import check_zero1_flat_step
from course_lib.checks.tensor_parallel import check_column_parallel_forward, check_row_parallel_linear
from course_lib.checks.training import check_average_gradients, check_bucket_all_reduce, check_momentum_server_step


def server_without_momentum(shard, velocity, workers, lr, momentum):
    for r in [dist.isend(shard, w) for w in workers]:
        r.wait()
    grads = [torch.empty_like(shard) for _ in workers]
    for r in [dist.irecv(g, w) for g, w in zip(grads, workers)]:
        r.wait()
    shard -= lr * torch.stack(grads).mean(0)


def server_pulling_twice(shard, velocity, workers, lr, momentum):   # sends the weights twice to each worker
    for r in [dist.isend(shard, w) for w in workers]:
        r.wait()
    server_without_momentum(shard, velocity, workers, lr, momentum)


def test_momentum_server_step():
    with pytest.raises(ExerciseFailed, match=r"with 1 workers the weights differ from single-process SGD with "
                                             r"momentum 0\.9 on the combined batch by up to"):
        check_momentum_server_step(server_without_momentum)


def plain_mean(model, batch_size):    # what section 1 did: right only when every batch has the same size
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def test_uneven_batches_are_weighted():
    with pytest.raises(ExerciseFailed) as e:
        check_average_gradients(plain_mean)
    assert "with 2 ranks holding [16, 12] samples" in str(e.value)
    assert "Your gradients equal the plain mean of the ranks' gradients" in str(e.value)


def two_buckets(tensors):
    half = len(tensors) // 2
    for part in (tensors[:half], tensors[half:]):
        flat = torch.cat([t.reshape(-1) for t in part])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        off = 0
        for t in part:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()


def test_one_bucket_one_all_reduce():
    with pytest.raises(ExerciseFailed, match=r"rank 0 of 2 ran \[\('all_reduce', 16\), \('all_reduce', 76\)\] "
                                             r"\(collective, bytes\); a bucket is one all_reduce"):
        check_bucket_all_reduce(two_buckets)


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
def reduce_to(v, dst):
    dist.all_reduce(v)            # also gives rank dst the sum, but it is not Reduce

def copy_from(w, src):
    dist.broadcast(w, src=src)

def sum_by_gathering(mine):
    raise NotImplementedError("Exercise 5b.3: all-reduce from all-gather: write your solution here")
'''


def test_cell_by_cell_checks_run_on_the_live_ranks(capsys):
    from course_lib.checks.cell_by_cell import check_copy_from, check_reduce_to, check_sum_by_gathering
    from course_lib.interactive import Ranks

    with Ranks(4, timeout=10) as ranks:
        ranks.run_cell(CELL_BY_CELL, show=False)
        check_copy_from(ranks)
        assert capsys.readouterr().out.startswith("✓ Exercise 5b.2 passed")
        # every rank calls the switched-off all_reduce; the first rank to report it is named
        with pytest.raises(ExerciseFailed, match=r"^Exercise 5b\.1 is about Reduce, which delivers the sum to one "
                                                 r"rank; dist\.all_reduce is switched off here\. \(rank \d\)"):
            check_reduce_to(ranks)
        with pytest.raises(NotImplementedError, match=r"^Exercise 5b\.3: not attempted yet\."):
            check_sum_by_gathering(ranks)
