"""The exercise checkers of notebooks 03-05 pass a correct solution and name the case and rank of a wrong one."""

import re

import pytest
import torch
import torch.distributed as dist

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.primitives import (
    check_all_gather,
    check_all_reduce,
    check_broadcast,
    check_odd_group_all_reduce,
    check_reduce_scatter_prediction,
    check_ring_exchange,
)


def good_broadcast(t, src):
    if dist.get_rank() == src:
        for dst in range(dist.get_world_size()):
            if dst != src:
                dist.send(t, dst=dst)
    else:
        dist.recv(t, src=src)
    return t


def bcast_from_zero(t, src):  # the classic slip: ignores src
    return good_broadcast(t, 0)


def good_all_gather(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [torch.empty_like(t) for _ in range(world)]
    out[rank] = t.clone()
    ops = [dist.P2POp(dist.isend, t, p) for p in range(world) if p != rank]
    ops += [dist.P2POp(dist.irecv, out[p], p) for p in range(world) if p != rank]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out


def gather_without_self(t):
    out = good_all_gather(t)
    out[dist.get_rank()] = torch.zeros_like(t)
    return out


def ring_ordered(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(t)
    if rank % 2 == 0:
        dist.send(t, dst=(rank + 1) % world)
        dist.recv(got, src=(rank - 1) % world)
    else:
        dist.recv(got, src=(rank - 1) % world)
        dist.send(t, dst=(rank + 1) % world)
    return got


def ring_deadlock(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(t)
    dist.send(t, dst=(rank + 1) % world)
    dist.recv(got, src=(rank - 1) % world)
    return got


def odd_good(t):
    odd = dist.new_group(list(range(1, dist.get_world_size(), 2)))
    if dist.get_rank() % 2:
        dist.all_reduce(t, group=odd)
    return t


def odd_everyone(t):  # reduces over the whole world instead of the group
    dist.all_reduce(t)
    return t


def rs_ag_all_reduce(t):
    world = dist.get_world_size()
    n = t.numel()
    padded = torch.nn.functional.pad(t, (0, -n % world))
    part = torch.empty(padded.numel() // world, dtype=t.dtype)
    dist.reduce_scatter_single(part, padded)
    dist.all_gather_single(padded, part)
    return padded[:n]


def rs_ag_no_pad_cut(t):  # forgets to cut the padding off
    world = dist.get_world_size()
    padded = torch.nn.functional.pad(t, (0, -t.numel() % world))
    part = torch.empty(padded.numel() // world, dtype=t.dtype)
    dist.reduce_scatter_single(part, padded)
    dist.all_gather_single(padded, part)
    return padded


def test_broadcast_passes_and_names_rank(capsys):
    check_broadcast(good_broadcast, worlds=(2, 3))
    assert "passed" in capsys.readouterr().out  # core prints the pass line
    with pytest.raises(ExerciseFailed, match=r"world_size=2, size=1, dtype=float32 on rank 0") as e:
        check_broadcast(bcast_from_zero, worlds=(2, 3))
    assert "expected" in str(e.value) and "Hint" in str(e.value)


def test_all_gather_passes_and_fails(capsys):
    check_all_gather(good_all_gather, worlds=(2, 4))
    assert "passed" in capsys.readouterr().out  # core prints the pass line
    with pytest.raises(ExerciseFailed, match=r"on rank 0"):
        check_all_gather(gather_without_self, worlds=(2,))


def test_deadlock_is_caught_fast_and_fix_passes(capsys):
    check_ring_exchange(ring_ordered, worlds=(2, 3))
    assert "passed" in capsys.readouterr().out  # core prints the pass line
    with pytest.raises(ExerciseFailed, match=r"world_size=2, size=1") as e:
        check_ring_exchange(ring_deadlock, worlds=(2,))
    assert re.search(r"Timed out|did not finish", str(e.value)) and "isend" in str(e.value)


def test_odd_group(capsys):
    check_odd_group_all_reduce(odd_good, worlds=(2, 3, 4))
    assert "passed" in capsys.readouterr().out  # core prints the pass line
    with pytest.raises(ExerciseFailed, match=r"on rank 0"):
        check_odd_group_all_reduce(odd_everyone, worlds=(3,))


def test_all_reduce_from_rs_ag_handles_uneven_sizes(capsys):
    check_all_reduce(rs_ag_all_reduce, worlds=(2, 3))
    assert "passed" in capsys.readouterr().out  # core prints the pass line
    with pytest.raises(ExerciseFailed, match=r"size=1"):
        check_all_reduce(rs_ag_no_pad_cut, worlds=(2,))


def test_reduce_scatter_prediction(capsys):
    inputs = [[1, 2, 3, 4], [10, 20, 30, 40]]
    check_reduce_scatter_prediction(inputs, [[11, 22], [33, 44]])
    assert "passed" in capsys.readouterr().out  # core prints the pass line
    with pytest.raises(ExerciseFailed, match=r"rank 0 really holds \[11.0, 22.0\]|rank 0 really holds \[11, 22\]"):
        check_reduce_scatter_prediction(inputs, [[11, 22, 33, 44], [11, 22, 33, 44]])
