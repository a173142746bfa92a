"""Exercise 6.1's checker: a ring passes; a star, a result not in place, the course's own ring and all-reduce by
another road fail with what was measured; rounds are counted as the algorithms' own (ring 2(p-1), binomial tree
2 lg p, recursive doubling lg p, star 2: Thakur, Rabenseifner & Gropp 2005)."""

import pytest
import torch
import torch.distributed as dist

from course_lib import run
from course_lib.checks.algorithms import check_ring_all_reduce, check_ring_bytes_prediction
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.watch import rounds, summary


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


def blocking_ring(t, even_first=True):
    """The same ring with blocking send/recv: even ranks send first (notebook 04), or rank 0 alone sends first."""
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = list(t.view(-1).tensor_split(p))
    first = rank % 2 == 0 if even_first else rank == 0

    def exchange(send, recv):
        for sending in ((True, False) if first else (False, True)):
            if sending and send.numel():
                dist.send(send, (rank + 1) % p)
            if not sending and recv.numel():
                dist.recv(recv, (rank - 1) % p)

    for s in range(p - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % p])
        exchange(chunks[(rank - s) % p], incoming)
        chunks[(rank - s - 1) % p] += incoming
    for s in range(p - 1):
        exchange(chunks[(rank + 1 - s) % p], chunks[(rank - s) % p])
    return t


def one_at_a_time_unless_divisible(t):
    """A ring whenever p divides n, else a ring in which only one rank at a time may pass (p rounds a step)."""
    return ring(t) if t.numel() % dist.get_world_size() == 0 else blocking_ring(t, even_first=False)


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


def test_a_blocking_ring_with_even_ranks_first_passes(capsys):
    check_ring_all_reduce(blocking_ring, world_sizes=(2, 3, 4, 5))
    assert "✓ Exercise 6.1 passed" in capsys.readouterr().out


def test_rounds_are_counted_when_p_does_not_divide_n():
    with pytest.raises(ExerciseFailed, match=r"the messages formed 12 rounds"):
        check_ring_all_reduce(one_at_a_time_unless_divisible, world_sizes=(3,), sizes=(3, 7), dtypes=(torch.float32,))


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
    from course_lib.checks.watch import Watch
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


def _predicted(rank, p, n):
    """Closed form: the reference ring skips chunk r in reduce-scatter and chunk r+1 in all-gather."""
    size = [n // p + (c < n % p) for c in range(p)]
    return 4 * (2 * n - size[rank] - size[(rank + 1) % p])


def _predicted_by_loop(rank, p, n):
    """The same, written as the two loops of the schedule."""
    chunks = [len(c) for c in torch.arange(n).tensor_split(p)]
    sent = sum(chunks[(rank - s - 1) % p] for s in range(p - 1))        # reduce-scatter
    sent += sum(chunks[(rank - s) % p] for s in range(p - 1))           # all-gather
    return 4 * sent


def test_ring_bytes_prediction():
    check_ring_bytes_prediction(_predicted)
    check_ring_bytes_prediction(_predicted_by_loop)
    with pytest.raises(ExerciseFailed, match=r"7 float32 on 3 ranks: you predicted 37 bytes for rank 0"):
        check_ring_bytes_prediction(lambda rank, p, n: round(2 * (p - 1) / p * n * 4))   # right only when p | n


def _on_a_persistent_group(rank, p, n):
    from course_lib.runtime.persistent_ranks import Ranks

    group = Ranks(p)
    group.start()
    try:
        group.run_cell(f"from course_lib.collectives import Traffic, ring_all_reduce\nt = Traffic()\n"
                       f"ring_all_reduce(torch.ones({n}), traffic=t)", show=False)
        return group.pull("t")[rank].bytes_sent
    finally:
        group.stop()


def test_ring_bytes_prediction_refuses_running_it():
    from course_lib.measure.comm_log import Call

    with pytest.raises(ExerciseFailed, match=r"persistent_ranks\.Ranks.* is switched off here"):
        check_ring_bytes_prediction(_on_a_persistent_group)
    with pytest.raises(ExerciseFailed, match=r"measure\.comm_log\.Call\.ring_bytes\.fget \(it holds the answer\)"):
        check_ring_bytes_prediction(lambda rank, p, n: Call("all_reduce", 4 * n, p).ring_bytes)
    assert Call("all_reduce", 40, 4).ring_bytes == 60        # and it works again afterwards
