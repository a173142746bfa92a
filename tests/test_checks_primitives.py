"""The exercise checkers of notebooks 04-05 pass a correct solution and reject wrong ones with a message that says
why: a wrong value (case and rank named), a collective the exercise switches off (however it was reached), the
course's own answer, traffic that is not the algorithm's. (Notebook 03's: tests/test_checks_groups.py.)"""

import re

import pytest
import torch
import torch.distributed as dist

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.primitives import (
    check_all_gather,
    check_all_reduce,
    check_broadcast,
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


def bcast_with_torch(t, src):  # the shortcut the exercise forbids
    dist.broadcast(t, src)
    return t


def bcast_through_the_group_object(t, src):  # the same shortcut, past the Python name
    dist.group.WORLD.broadcast(t, src).wait()
    return t


def bcast_caught(t, src):  # catches the refusal and goes on with send/recv
    try:
        dist.broadcast(t, src)
    except Exception:
        pass
    return good_broadcast(t, src)


def bcast_twice(t, src):  # right values, but every rank receives the tensor twice
    good_broadcast(t, src)
    return good_broadcast(t, src)


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


def gather_from_the_course(t):
    from course_lib.collectives import ring_all_gather

    return ring_all_gather(t)


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


def ring_by_all_gather(t):  # no deadlock, no point-to-point either
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out[(dist.get_rank() - 1) % dist.get_world_size()]


def rs_ag_all_reduce(t):
    world = dist.get_world_size()
    n = t.numel()
    padded = torch.nn.functional.pad(t, (0, -n % world))
    part = torch.empty(padded.numel() // world, dtype=t.dtype, device=t.device)
    dist.reduce_scatter_single(part, padded)
    dist.all_gather_single(padded, part)
    return padded[:n]


def rs_ag_no_pad_cut(t):  # forgets to cut the padding off
    world = dist.get_world_size()
    padded = torch.nn.functional.pad(t, (0, -t.numel() % world))
    part = torch.empty(padded.numel() // world, dtype=t.dtype, device=t.device)
    dist.reduce_scatter_single(part, padded)
    dist.all_gather_single(padded, part)
    return padded


def all_reduce_by_functional(t):  # the forbidden collective through torch.distributed._functional_collectives
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(t, "sum", dist.group.WORLD)


def all_reduce_by_c10d_module(t):  # ... and through the module the Python names come from
    dist.distributed_c10d.all_reduce(t)
    return t


def broadcast_into_a_copy(t, src):      # the right values, returned in a new tensor: t itself is left as it was
    out = t.clone()
    good_broadcast(out, src)
    return out


def bcast_chain_down(t, src):   # a chain src -> src-1 -> ... -> 0: ranks above src never receive
    rank = dist.get_rank()
    if rank < src:
        dist.recv(t, src=rank + 1)
    if 0 < rank <= src:
        dist.send(t, dst=rank - 1)
    return t


def bcast_to_range_src(t, src):   # "the other ranks" slipped into range(src): ranks above src never receive
    if dist.get_rank() == src:
        for dst in range(src):
            dist.send(t, dst=dst)
    elif dist.get_rank() < src:
        dist.recv(t, src=src)
    return t


def bcast_from_last(t, src):   # ignores src and always broadcasts from the last rank
    return good_broadcast(t, dist.get_world_size() - 1)


def bcast_binomial_tree(t, src):   # a correct broadcast written differently: a binomial tree on ranks relative to src
    rank, world = dist.get_rank(), dist.get_world_size()
    me, step = (rank - src) % world, 1
    while step < world:
        if me < step and me + step < world:
            dist.send(t, dst=(me + step + src) % world)
        elif step <= me < 2 * step:
            dist.recv(t, src=(me - step + src) % world)
        step *= 2
    return t


@pytest.mark.parametrize("wrong, rank", [(bcast_chain_down, 2), (bcast_to_range_src, 2), (bcast_from_last, 0)])
def test_broadcast_tries_several_srcs(wrong, rank):
    # each of these passes with src = the last rank; on 3 ranks the middle src (1) gives a rank the wrong tensor
    with pytest.raises(ExerciseFailed, match=rf"with world_size=3, size=7, dtype=float32, src=1 on rank {rank}\."):
        check_broadcast(wrong, worlds=(3,))


def test_broadcast_accepts_a_tree(capsys):
    check_broadcast(bcast_binomial_tree, worlds=(3, 5))
    assert "✓ Exercise 4.2 passed" in capsys.readouterr().out


def test_broadcast_passes_and_wrong_ones_are_named(capsys):
    check_broadcast(good_broadcast, worlds=(2, 3))
    assert "✓ Exercise 4.2 passed" in capsys.readouterr().out
    wrong = r"wrong result with world_size=2, size=1, dtype=float32, src=1 on rank 0"
    with pytest.raises(ExerciseFailed, match=wrong) as e:
        check_broadcast(bcast_from_zero, worlds=(2,))
    assert "expected" in str(e.value) and "Hint" in str(e.value)
    with pytest.raises(ExerciseFailed, match=r"rank \d.s tensor itself does not hold the result \(it must work in"):
        check_broadcast(broadcast_into_a_copy, worlds=(2,))


def test_broadcast_forbids_dist_broadcast_however_reached():
    with pytest.raises(ExerciseFailed) as e:
        check_broadcast(bcast_with_torch, worlds=(2,))
    assert str(e.value).startswith("Exercise 4.2 is about building broadcast from send/recv; dist.broadcast is "
                                   "switched off here.")
    with pytest.raises(ExerciseFailed, match=re.escape("broadcast (reached as torch.ops.c10d.broadcast_) is "
                                                       "switched off here")):
        check_broadcast(bcast_through_the_group_object, worlds=(2,))
    with pytest.raises(ExerciseFailed, match=r"dist\.broadcast is switched off here\. \(your code caught the error"):
        check_broadcast(bcast_caught, worlds=(2,))


def test_broadcast_traffic_is_counted():
    with pytest.raises(ExerciseFailed, match=r"rank 0 received 8 bytes in 2 message\(s\); in a broadcast from rank 1 "
                                             r"every other rank receives the tensor \(4 bytes\) exactly once"):
        check_broadcast(bcast_twice, worlds=(2,))


def test_all_gather_passes_and_fails(capsys):
    check_all_gather(good_all_gather, worlds=(2, 4))
    assert "✓ Exercise 4.3 passed" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match=r"on rank 0"):
        check_all_gather(gather_without_self, worlds=(2,))
    with pytest.raises(ExerciseFailed, match=re.escape("Exercise 4.3 is about building all-gather from send/recv; "
                                                       "the course's own collectives.ring.ring_all_gather (it holds "
                                                       "the answer) is switched off here.")):
        check_all_gather(gather_from_the_course, worlds=(2,))


def test_deadlock_is_caught_fast_and_fix_passes(capsys):
    check_ring_exchange(ring_ordered, worlds=(2, 3))
    assert "✓ Exercise 4.1 passed" in capsys.readouterr().out
    # the checker runs the learner's code under the NCCL rules, which name the cycle of waiting ranks at once
    deadlocked = r"deadlocked: every rank waited for another with world_size=2, size=1"
    with pytest.raises(ExerciseFailed, match=deadlocked) as e:
        check_ring_exchange(ring_deadlock, worlds=(2,), timeout=3)
    assert "rank 0 waits in dist.send(dst=1)" in str(e.value) and "which is itself waiting" in str(e.value)
    assert "(ring_deadlock, line" in str(e.value)    # the learner's own line, not the checker's wrapper
    assert "Hint: If it hung, read your traceback" in str(e.value)  # the hint points at the learner's own evidence
    with pytest.raises(ExerciseFailed, match=r"dist\.all_gather is switched off here"):
        check_ring_exchange(ring_by_all_gather, worlds=(2,))


def test_all_reduce_from_rs_ag_handles_uneven_sizes(capsys):
    check_all_reduce(rs_ag_all_reduce, worlds=(2, 3))
    assert "✓ Exercise 5.2 passed" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match=r"size=1"):
        check_all_reduce(rs_ag_no_pad_cut, worlds=(2,))
    with pytest.raises(ExerciseFailed, match=re.escape("Exercise 5.2 is about building all-reduce from "
                                                       "reduce-scatter and all-gather; all_reduce (reached as "
                                                       "torch.ops._c10d_functional.all_reduce) is switched off")):
        check_all_reduce(all_reduce_by_functional, worlds=(2,))
    with pytest.raises(ExerciseFailed, match=r"dist\.all_reduce is switched off here"):
        check_all_reduce(all_reduce_by_c10d_module, worlds=(2,))


def test_reduce_scatter_prediction(capsys):
    inputs = [[1, 2, 3, 4], [10, 20, 30, 40]]
    check_reduce_scatter_prediction(inputs, lambda: [[11, 22], [33, 44]])
    assert "✓ Exercise 5.1 passed" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match=r"rank 0 really holds \[11.0, 22.0\]|rank 0 really holds \[11, 22\]"):
        check_reduce_scatter_prediction(inputs, lambda: [[11, 22, 33, 44], [11, 22, 33, 44]])

    def run_it():  # not a prediction: launching ranks is switched off inside it
        from course_lib import run

        return run(lambda: None, 2).values

    with pytest.raises(ExerciseFailed, match=r"Exercise 5\.1 is about predicting a reduce-scatter before running "
                                             r"it; the course's own launch\.run \(it holds the answer\) is switched"):
        check_reduce_scatter_prediction(inputs, run_it)


def rs_repeat_then_throwaway_ag(t):  # right numbers: the reduce-scatter of p copies is already the all-reduce
    world = dist.get_world_size()
    out = torch.empty_like(t)
    dist.reduce_scatter_single(out, t.repeat(world))
    dist.all_gather_single(torch.empty_like(out.repeat(world)), out)
    return out


def rs_ag_by_cat(t):  # correct, written differently: cat instead of pad, a new output, a clone of its front
    world = dist.get_world_size()
    n, chunk = t.numel(), -(-t.numel() // world)
    full = torch.cat([t, t.new_zeros(chunk * world - n)])
    mine = t.new_empty(chunk)
    dist.reduce_scatter_single(mine, full)
    gathered = t.new_empty(chunk * world)
    dist.all_gather_single(gathered, mine)
    return gathered.narrow(0, 0, n).clone()


def test_all_reduce_from_rs_ag_checks_what_each_collective_moves(capsys):
    check_all_reduce(rs_ag_by_cat, worlds=(2, 3))
    assert "✓ Exercise 5.2 passed" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match=r"reduce_scatter_single took \d+ bytes in"):
        check_all_reduce(rs_repeat_then_throwaway_ag, worlds=(2,))


def test_reduce_scatter_prediction_cannot_start_ranks_any_way():
    inputs = [[1, 2, 3, 4], [10, 20, 30, 40], [5, 6, 7, 8]]

    def by_persistent_ranks():  # a group of one's own, with the real collective
        from course_lib.runtime.persistent_ranks import Ranks

        ranks = Ranks(3).start()
        try:
            ranks.run_cell("out = torch.empty(1)\ndist.reduce_scatter_single(out, torch.tensor(["
                           "[1., 2, 3, 4], [10., 20, 30, 40], [5., 6, 7, 8]][rank][:3]))", show=False)
            return [v.tolist() for v in ranks.pull("out")]
        finally:
            ranks.stop()

    def by_torch_spawn():
        import torch.multiprocessing as mp

        mp.start_processes(lambda i: None, nprocs=3, start_method="fork")
        return [[0]] * 3

    def by_subprocess():
        import subprocess
        import sys

        subprocess.run([sys.executable, "-c", "pass"], check=True)
        return [[0]] * 3

    for way in (by_persistent_ranks, by_torch_spawn, by_subprocess):
        with pytest.raises(ExerciseFailed, match=r"Exercise 5\.1 is about predicting a reduce-scatter before running "
                                                 r"it; starting ranks or processes \(.+\) is switched off here"):
            check_reduce_scatter_prediction(inputs, way)


def ring_launches_its_own_ranks(t):  # on a rank: a group of its own would run collectives the check switched off
    from course_lib.runtime.launch import run

    run(lambda: None, 2)
    return t


def test_ranks_cannot_start_ranks_of_their_own():
    with pytest.raises(ExerciseFailed, match=r"starting ranks or processes \(course_lib\.runtime\.launch\.run\)"):
        check_ring_exchange(ring_launches_its_own_ranks, worlds=(2,))


def ring_batched(t):  # right numbers, but not the order of blocking calls the exercise asks for
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, (rank + 1) % world), dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return got


def ring_nonblocking(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(t)
    works = [dist.irecv(got, src=(rank - 1) % world), dist.isend(t, dst=(rank + 1) % world)]
    for w in works:
        w.wait()
    return got


def ring_process_group_object(t):  # irecv-then-isend by another road: the ProcessGroup's own send/recv
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(t)
    pg = dist.group.WORLD
    works = [pg.recv([got], (rank - 1) % world, 0), pg.send([t], (rank + 1) % world, 0)]
    for w in works:
        w.wait()
    return got


def ring_chain(t):  # correct, written differently: rank 0 starts a chain, the others receive first
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(t)
    if rank == 0:
        dist.send(t, dst=1)
        dist.recv(got, src=world - 1)
    else:
        dist.recv(got, src=rank - 1)
        dist.send(t, dst=(rank + 1) % world)
    return got


def ring_wrong_way(t):  # no deadlock, but the tensor goes left
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(t)
    if rank == 0:
        dist.send(t, dst=world - 1)
        dist.recv(got, src=1)
    else:
        dist.recv(got, src=(rank + 1) % world)
        dist.send(t, dst=rank - 1)
    return got


def test_ring_exchange_wants_blocking_calls_in_an_order(capsys):
    check_ring_exchange(ring_chain, worlds=(2, 3, 5))
    assert "✓ Exercise 4.1 passed" in capsys.readouterr().out
    for way, name in ((ring_batched, "batch_isend_irecv"), (ring_nonblocking, "irecv")):
        with pytest.raises(ExerciseFailed, match=rf"dist\.{name} is switched off here"):
            check_ring_exchange(way, worlds=(3,))
    with pytest.raises(ExerciseFailed, match=r"blocking dist\.send and dist\.recv only.*c10d\.recv_"):
        check_ring_exchange(ring_process_group_object, worlds=(3,))
    with pytest.raises(ExerciseFailed, match=r"wrong result"):
        check_ring_exchange(ring_wrong_way, worlds=(3,))
