"""Notebook 08's checkers, each against the four kinds of answer a checker must tell apart: the library's shortcut
(refused), a wrong method that gives the right numbers (refused), a wrong result (refused, with the measured figures)
and a right solution written differently from the notebook's (accepted); plus the colocated PS they measure."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib import run
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.parameter_server import check_busiest_nic_bytes, check_sharded_push_pull
from course_lib.training import train_single
from course_lib.training.ps import ps_train
from course_lib.training.tolerance import max_diff, sgd_atol

N = 3466          # parameters of the checkers' model (hidden=32)
M = 4 * N


# ------------------------------------------------------------------------------------------- the colocated PS
@pytest.mark.parametrize("n", [1, 3, 4])
def test_colocated_ps_is_single_process_sgd_and_keeps_its_own_shard_home(n):
    res = run(ps_train, world_size=n, kwargs=dict(steps=3, batch_size=16, hidden=32, colocated=True),
              output="none", timeout=60, nccl_rules=True)
    ref = train_single(n, 3, 16, hidden=32)[0]
    assert all(max_diff(v["params"], ref) <= sgd_atol(3, 0.1, n * 16, 32) for v in res.values)
    shard = [N // n + (r < N % n) for r in range(n)]     # chunk_bounds: the first N mod n one longer
    for r, v in enumerate(res.values):     # out: the others' gradient pieces and my shard to n - 1 workers; as much in
        assert all(step == (4 * (N + (n - 2) * shard[r]),) * 2 for step in v["traffic"])


def test_colocated_ps_refuses_async():
    with pytest.raises(Exception, match="colocated parameter server is synchronous"):
        run(ps_train, world_size=2, kwargs=dict(steps=1, colocated=True, mode="async"), backend="gloo",
            output="none", timeout=60)


# ------------------------------------------------------------------------------------------- 8.1
def test_busiest_nic_refuses_the_library_formulas():
    from course_lib.costs import alpha_beta, projection
    from course_lib.measure import emulated_link

    with pytest.raises(ExerciseFailed, match=r"alpha_beta\.ps_vs_allreduce \(it holds the answer\) is switched off"):
        check_busiest_nic_bytes(lambda n, m: alpha_beta.ps_vs_allreduce(n, m, 1.0)["allreduce_s"])
    with pytest.raises(ExerciseFailed, match=r"projection\.ps_step \(it holds the answer\) is switched off"):
        unit = emulated_link.Link("unit", 0.0, 1.0)
        check_busiest_nic_bytes(lambda n, m: projection.ps_step(n, m, unit, n, 0.0, True))
    with pytest.raises(ExerciseFailed, match=r"alpha_beta\.byteps_optimal \(it holds the answer\) is switched off"):
        check_busiest_nic_bytes(lambda n, m: alpha_beta.byteps_optimal(n, m, 1.0, 0))


def _by_running(n, m):
    got = run(ps_train, world_size=n, kwargs=dict(steps=1, colocated=True, hidden=32), output="none").values
    return max(v["traffic"][0][0] for v in got)


def test_busiest_nic_refuses_running_the_ps():
    with pytest.raises(ExerciseFailed, match=r"course's own launch\.run \(it holds the answer\) is switched off"):
        check_busiest_nic_bytes(_by_running)


def test_busiest_nic_refuses_right_numbers_from_a_lookup_table():
    table = {1: 0, 2: 13864, 3: 18488, 4: 20800}         # what the runs of 1-4 machines count, copied
    with pytest.raises(ExerciseFailed, match=r"n=5 machines, M=13864 bytes: you said 27728, which is not what"):
        check_busiest_nic_bytes(lambda n, m: table.get(n, 2 * m))


def test_busiest_nic_refuses_wrong_results_with_the_measured_bytes():
    with pytest.raises(ExerciseFailed, match=r"n=2 machines, M=13864 bytes: you said 27728; the busiest NIC really "
                                             r"sent 13864 and received 13864 bytes"):
        check_busiest_nic_bytes(lambda n, m: 2 * m)           # a worker's M plus a server's M: the own shard moved
    with pytest.raises(ExerciseFailed, match=r"n=3 machines, M=13864 bytes: you said 13864; the busiest NIC"):
        check_busiest_nic_bytes(lambda n, m: n * m / n)       # n·M/k with k = n: servers on machines of their own
    with pytest.raises(ExerciseFailed, match=r"n=2: you returned True, not a number of bytes"):
        check_busiest_nic_bytes(lambda n, m: True)


def test_busiest_nic_accepts_right_answers_of_any_numeric_type():
    check_busiest_nic_bytes(lambda n, m: 2 * (n - 1) * m / n)                       # the shards' rounding ignored
    check_busiest_nic_bytes(lambda n, m: np.int64(4 * (m // 4 + (n - 2) * math.ceil(m / 4 / n))))  # exact, numpy
    check_busiest_nic_bytes(lambda n, m: torch.tensor(2.0 * (n - 1) * m / n))      # a 0-d tensor


# ------------------------------------------------------------------------------------------- 8.2
def _bounds(numel, k):
    return [(int(p[0]), int(p[-1]) + 1) for p in torch.tensor_split(torch.arange(numel), k)]


def push_pull_by_the_library(grad, params, servers):
    from course_lib.collectives import chunk_bounds
    from course_lib.training.ps import _push_pull

    bounds = chunk_bounds(grad.numel(), len(servers))
    bufs = [torch.empty(hi - lo) for lo, hi in bounds]
    _push_pull(grad, params, bounds, servers, bufs, [0] * len(servers))


def push_pull_after_averaging_among_workers(grad, params, servers):
    """Right weights, wrong method: the workers first average their gradients among themselves (an all-reduce by
    hand), then push the average; the servers' mean of equal averages is the same mean."""
    rank, world = dist.get_rank(), dist.get_world_size()
    others = [w for w in range(len(servers), world) if w != rank]
    total = grad.clone()
    for w in others:
        theirs = torch.empty_like(grad)
        if rank < w:
            dist.send(grad, w)
            dist.recv(theirs, w)
        else:
            dist.recv(theirs, w)
            dist.send(grad, w)
        total += theirs
    avg = total / (len(others) + 1)
    for (lo, hi), s in zip(_bounds(grad.numel(), len(servers)), servers):
        dist.send(avg[lo:hi], s)
    for (lo, hi), s in zip(_bounds(grad.numel(), len(servers)), servers):
        dist.recv(params[lo:hi], s)


def push_pull_without_writing_back(grad, params, servers):      # pulls into a copy: the weights never change
    scratch = params.clone()
    for (lo, hi), s in zip(_bounds(grad.numel(), len(servers)), servers):
        dist.send(grad[lo:hi], s)
    for (lo, hi), s in zip(_bounds(grad.numel(), len(servers)), servers):
        dist.recv(scratch[lo:hi], s)


def push_pull_with_torch_chunk(grad, params, servers):          # torch.chunk's shards: ceil(N/k) each but the last
    for g, s in zip(torch.chunk(grad, len(servers)), servers):
        dist.send(g, s)
    for p, s in zip(torch.chunk(params, len(servers)), servers):
        dist.recv(p, s)


def push_pull_batched(grad, params, servers):                   # right, written differently: one batch, then copies
    pieces = torch.tensor_split(grad, len(servers))
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, p.contiguous(), s) for p, s in zip(pieces, servers)])
    for w in works:
        w.wait()
    new = [torch.empty_like(p) for p in pieces]
    for t, s in zip(new, servers):
        dist.recv(t, src=s)
    params.copy_(torch.cat(new))


def push_pull_by_the_librarys_pieces(grad, params, servers):
    from course_lib.collectives import chunk_bounds
    from course_lib.training.ps import _push_pull_pieces

    _push_pull_pieces(grad, params, chunk_bounds(params.numel(), len(servers)), servers, 1)


def test_push_pull_refuses_the_library():
    with pytest.raises(ExerciseFailed, match=r"training\.ps\._push_pull \(it holds the answer\) is switched off"):
        check_sharded_push_pull(push_pull_by_the_library)
    with pytest.raises(ExerciseFailed, match=r"ps\._push_pull_pieces \(it holds the answer\) is switched off"):
        check_sharded_push_pull(push_pull_by_the_librarys_pieces)


def test_push_pull_refuses_workers_talking_to_workers():
    # whichever of the two workers' ranks reaches the other first is reported: the sender or the receiver
    with pytest.raises(ExerciseFailed, match=r"your worker \(rank [34]\) (sent a message to|posted a receive from) "
                                             r"rank [34], another worker"):
        check_sharded_push_pull(push_pull_after_averaging_among_workers)


def test_push_pull_refuses_wrong_results():
    with pytest.raises(ExerciseFailed, match=r"sent a message of 4624 B to server 1 \(rank 1\), whose shard is "
                                             r"1155 float32"):
        check_sharded_push_pull(push_pull_with_torch_chunk)
    with pytest.raises(ExerciseFailed, match=r"with 2 workers and 3 servers every message went where it should, but "
                                             r"the workers' final weights differ"):
        check_sharded_push_pull(push_pull_without_writing_back)


def test_push_pull_accepts_a_batched_solution(capsys):
    check_sharded_push_pull(push_pull_batched)
    assert "Exercise 8.2 passed" in capsys.readouterr().out
