"""Exercise 6.1's checker: a ring passes; a star, a result not in place, the course's own ring and all-reduce by
another road fail with what was measured; rounds are counted as the algorithms' own (ring 2(p-1), binomial tree
2 lg p, recursive doubling lg p, star 2: Thakur, Rabenseifner & Gropp 2005)."""

import pytest
import torch
import torch.distributed as dist

from course_lib import run
from course_lib.checks.algorithms import check_ring_all_reduce, check_ring_bytes_prediction
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.traffic import rounds, summary


def ring(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = list(t.view(-1).tensor_split(p))

    def exchange(send, recv):   # one batch: the checker runs under the NCCL rules
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % p)] if send.numel() else []
        ops += [dist.P2POp(dist.irecv, recv, (rank - 1) % p)] if recv.numel() else []
        for r in dist.batch_isend_irecv(ops) if ops else []:
            r.wait()

    for s in range(p - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % p])
        exchange(chunks[(rank - s) % p], incoming)
        chunks[(rank - s - 1) % p] += incoming
    for s in range(p - 1):
        exchange(chunks[(rank + 1 - s) % p], chunks[(rank - s) % p])
    return t


def star(t):  # the right sum, through rank 0
    rank, p = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        buf = torch.empty_like(t)
        for r in range(1, p):
            dist.recv(buf, r)
            t += buf
        for r in range(1, p):
            dist.send(t, r)
    else:
        dist.send(t, 0)
        dist.recv(t, 0)
    return t


def not_in_place(t):
    return ring(t.clone())


def the_course_ring(t):
    from course_lib.collectives import ring_all_reduce

    return ring_all_reduce(t)


def through_torch_ops(t):
    dist.group.WORLD.allreduce([t]).wait()
    return t


def test_a_ring_passes(capsys):
    check_ring_all_reduce(ring, world_sizes=(1, 3, 4))
    assert "✓ Exercise 6.1 passed" in capsys.readouterr().out


def test_a_star_is_not_a_ring():
    with pytest.raises(ExerciseFailed) as e:
        check_ring_all_reduce(star, world_sizes=(3,), sizes=(12,), dtypes=(torch.float32,))
    text = str(e.value)
    assert "rank 0 sent to ranks [1, 2]" in text
    assert "a ring sends each rank's 2(p-1)/p·n = 64 bytes in 2(p-1) = 4 messages" in text
    assert "Measured: rank 0: 96 B in 2 messages to [1, 2]; rank 1: 48 B in 1 messages to [0]" in text


def test_in_place_library_and_other_roads_are_refused():
    with pytest.raises(ExerciseFailed, match=r"rank 0's tensor itself does not hold the result"):
        check_ring_all_reduce(not_in_place, world_sizes=(2,))
    with pytest.raises(ExerciseFailed, match=r"Exercise 6\.1 is about building all_reduce from send/recv; the "
                                             r"course's own collectives\.ring\.ring_all_reduce"):
        check_ring_all_reduce(the_course_ring, world_sizes=(2,))
    with pytest.raises(ExerciseFailed, match=r"^Exercise 6\.1 is about building all_reduce from send/recv; "
                                             r"all_reduce \(reached as torch\.ops\.c10d\.allreduce_\) is switched "
                                             r"off here\."):
        check_ring_all_reduce(through_torch_ops, world_sizes=(2,))


def _four_algorithms():
    from course_lib.checks.traffic import Watch
    from course_lib.collectives import recursive_doubling_all_reduce, ring_all_reduce, star_all_reduce, tree_all_reduce

    out = {}
    for name, algo in (("ring", ring_all_reduce), ("tree", tree_all_reduce),
                       ("recursive doubling", recursive_doubling_all_reduce), ("star", star_all_reduce)):
        with Watch() as log:
            algo(torch.ones(16))
        out[name] = log.record()
    return out


def test_rounds_and_bytes_are_the_algorithms_own():
    records = run(_four_algorithms, 4, output="none", timeout=30).values
    got = {name: rounds([r[name] for r in records]) for name in records[0]}
    assert got == {"ring": 6, "tree": 4, "recursive doubling": 2, "star": 2}
    ring_sent = [summary(r["ring"])["bytes_sent"] for r in records]
    assert ring_sent == [2 * 3 * 16 * 4 // 4] * 4                  # 2(p-1)/p·n on every rank
    assert [summary(r["star"])["messages_sent"] for r in records] == [3, 1, 1, 1]


def test_ring_bytes_prediction():
    check_ring_bytes_prediction(lambda: 60)
    with pytest.raises(ExerciseFailed, match=r"you predicted 56 bytes; rank 1 really sent 60"):
        check_ring_bytes_prediction(lambda: 56)
