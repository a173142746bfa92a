"""The checkers of notebooks 11 and 11b reject the mistakes their exercises are about, with a message that says which,
and accept correct answers written otherwise than the worked notebooks' (whose check cells nbval runs)."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.decentralized import (
    check_diloco_outer_step,
    check_one_peer_gossip,
    check_powersgd_crossover,
    check_rounds_to_consensus,
)
from course_lib.training import gossip, local_sgd


def _rounds(rho, eps):
    if rho >= 1 - 1e-12:
        return math.inf
    t = 0
    while rho ** t > eps:
        t += 1
    return t


def test_rounds_to_consensus_accepts_the_norm_and_rejects_eigvalsh_and_signed_eigenvalues():
    check_rounds_to_consensus(lambda w, eps: _rounds(torch.linalg.matrix_norm(w - 1 / w.shape[0], ord=2).item(), eps))
    # eigvalsh reads one triangle only: wrong for the exponential graph, whose W is not symmetric
    with pytest.raises(ExerciseFailed, match="exponential"):
        check_rounds_to_consensus(lambda w, eps: _rounds(abs(torch.linalg.eigvalsh(w)[-2].item()), eps))
    # the second-largest eigenvalue without |.| (right wherever it is the largest in size): misses the -1 of a ring
    # that keeps none of itself, whose replicas swap forever
    def signed(w, eps):
        if torch.equal(w, w.T):
            return _rounds(torch.linalg.eigvalsh(w)[-2].item(), eps)
        return _rounds(torch.linalg.matrix_norm(w - 1 / w.shape[0], ord=2).item(), eps)

    with pytest.raises(ExerciseFailed, match="keeping no share of itself"):
        check_rounds_to_consensus(signed)
    # one round too many: the message says which way, never the count itself (the first case: the ring of 4)
    with pytest.raises(ExerciseFailed, match="too many") as err:
        check_rounds_to_consensus(lambda w, eps: 1 + _rounds(torch.linalg.matrix_norm(w - 1 / w.shape[0], ord=2).item(),
                                                             eps))
    want = _rounds(torch.linalg.matrix_norm(gossip.mixing_matrix("ring", 4) - 1 / 4, ord=2).item(), 1e-2)
    assert "ring, p=4" in str(err.value) and f" {want} round" not in str(err.value)


def _all_reduce_average(x, t):
    y = x.clone()
    dist.all_reduce(y)
    return y / dist.get_world_size()


def _both_directions(x, t):
    rank, p = dist.get_rank(), dist.get_world_size()
    hop = 2 ** (t % (p - 1).bit_length())
    left, right = torch.empty_like(x), torch.empty_like(x)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, left, (rank - hop) % p),
                                   dist.P2POp(dist.irecv, right, (rank + hop) % p),
                                   dist.P2POp(dist.isend, x, (rank + hop) % p),
                                   dist.P2POp(dist.isend, x, (rank - hop) % p)])
    for r in reqs:
        r.wait()
    return (x + left) / 2


def _reversed(x, t):                           # one message each way, but the hop's direction reversed
    rank, p = dist.get_rank(), dist.get_world_size()
    hop = 2 ** (t % (p - 1).bit_length())
    got = torch.empty_like(x)
    for r in dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, (rank + hop) % p),
                                     dist.P2POp(dist.isend, x, (rank - hop) % p)]):
        r.wait()
    return (x + got) / 2


def _library_offsets(x, t):                    # the course's own table of hops holds the answer
    from course_lib.training import gossip
    return gossip._offsets("one-peer exponential", dist.get_world_size(), t)


def test_one_peer_gossip_rejects_all_reduce_extra_messages_wrong_peers_and_the_librarys_hops():
    with pytest.raises(ExerciseFailed, match="dist.all_reduce is switched off"):
        check_one_peer_gossip(_all_reduce_average)
    with pytest.raises(ExerciseFailed, match=r"sent 2 message\(s\)"):
        check_one_peer_gossip(_both_directions)
    with pytest.raises(ExerciseFailed, match=r"one message each way, but not to and from round 0's peers") as e:
        check_one_peer_gossip(_reversed)
    assert "[1]" not in str(e.value).split("peers.")[1]        # the message never names the right peer
    with pytest.raises(ExerciseFailed, match=r"gossip._offsets \(it holds the answer\) is switched off"):
        check_one_peer_gossip(_library_offsets)


def _heavy_ball(flat, anchor, momentum):
    delta = anchor - flat
    dist.all_reduce(delta)
    delta /= dist.get_world_size()
    momentum.mul_(0.9).add_(delta)
    anchor.sub_(0.7 * momentum)
    flat.copy_(anchor)


def _two_messages(flat, anchor, momentum):
    delta = anchor - flat
    for part in delta.chunk(2):
        dist.all_reduce(part)
    delta /= dist.get_world_size()
    momentum.mul_(0.9).add_(delta)
    anchor.sub_(0.7 * (delta + 0.9 * momentum))
    flat.copy_(anchor)


def _summed(flat, anchor, momentum):
    delta = anchor - flat
    dist.all_reduce(delta)
    momentum.mul_(0.9).add_(delta)
    anchor.sub_(0.7 * (delta + 0.9 * momentum))
    flat.copy_(anchor)


def _flipped(flat, anchor, momentum):
    delta = flat - anchor
    dist.all_reduce(delta)
    delta /= dist.get_world_size()
    momentum.mul_(0.9).add_(delta)
    anchor.sub_(0.7 * (delta + 0.9 * momentum))
    flat.copy_(anchor)


def _fresh_optimizer(flat, anchor, momentum):        # torch's SGD, but its own buffer, empty at every call
    mean = flat.clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    w = torch.nn.Parameter(anchor)
    w.grad = anchor - mean
    torch.optim.SGD([w], lr=local_sgd.OUTER_LR, momentum=local_sgd.OUTER_MOMENTUM, nesterov=True).step()
    flat.copy_(anchor)


def _library(flat, anchor, momentum):
    local_sgd.diloco_outer_step(flat, anchor, momentum, dist.all_reduce)


def _torch_sgd(flat, anchor, momentum):
    # torch's own optimizer on the anchor, its buffer the caller's: the pseudo-gradient as the gradient
    mean = flat.clone()
    dist.all_reduce(mean)                  # the mean of the models: anchor - mean is the mean pseudo-gradient
    mean /= dist.get_world_size()
    w = torch.nn.Parameter(anchor)         # shares anchor's storage: the step changes anchor in place
    w.grad = anchor - mean
    opt = torch.optim.SGD([w], lr=local_sgd.OUTER_LR, momentum=local_sgd.OUTER_MOMENTUM, nesterov=True)
    opt.state[w]["momentum_buffer"] = momentum
    opt.step()
    flat.copy_(anchor)


def _sutskever(flat, anchor, momentum):
    # Nesterov as Sutskever et al. (ICML 2013) write it, v <- mu v - lr g, x <- x - mu v_old + (1 + mu) v: the same
    # steps as torch's with v = -lr buf, so the weights agree although the buffer holds -lr times torch's
    g = anchor - flat
    dist.all_reduce(g)
    g /= dist.get_world_size()
    old = momentum.clone()
    momentum.mul_(0.9).sub_(0.7 * g)
    anchor.add_(-0.9 * old + 1.9 * momentum)
    flat.copy_(anchor)


def test_diloco_outer_step_refuses_the_library_extra_messages_and_the_usual_mistakes():
    with pytest.raises(ExerciseFailed, match=r"local_sgd.diloco_outer_step \(it holds the answer\) is switched off"):
        check_diloco_outer_step(_library)
    with pytest.raises(ExerciseFailed, match="exactly one all_reduce"):
        check_diloco_outer_step(_two_messages)
    for wrong, named in ((_heavy_ball, "plain \\(heavy-ball\\) momentum"), (_summed, "summed, not averaged"),
                         (_flipped, "sign flipped"), (_fresh_optimizer, "starts empty every round")):
        with pytest.raises(ExerciseFailed, match=named) as err:
            check_diloco_outer_step(wrong)
        assert "mu * momentum" not in str(err.value)            # the message never writes the update out


def test_diloco_outer_step_accepts_torch_sgd_and_sutskevers_form(capsys):
    check_diloco_outer_step(_torch_sgd)
    check_diloco_outer_step(_sutskever)
    assert capsys.readouterr().out.count("passed") == 2


def _loses_from(alpha, bandwidth, m, c):
    """(d) the condition solved: p alpha > 4 (m - c) / B."""
    return max(2, math.floor(4 * (m - c) / (alpha * bandwidth)) + 1)


def _loses_from_by_search(alpha, bandwidth, m, c):
    """(d) another way: the learner's own ring formula, p increased until PowerSGD's two all-reduces are slower."""
    def ring(p, numbers):
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * 4 * numbers / bandwidth
    p = 2
    while 2 * ring(p, c / 2) <= ring(p, m):
        p += 1
    return p


def test_powersgd_crossover_wants_the_derived_condition(capsys):
    check_powersgd_crossover(_loses_from)
    check_powersgd_crossover(lambda a, b, m, c: np.int64(_loses_from(a, b, m, c)))
    check_powersgd_crossover(_loses_from_by_search)
    assert capsys.readouterr().out.count("passed") == 3
    with pytest.raises(ExerciseFailed, match=r"alpha_beta\.ring_allreduce \(it holds the answer\) is switched off"):
        from course_lib.costs import alpha_beta
        check_powersgd_crossover(lambda a, b, m, c: next(
            p for p in range(2, 10**6) if alpha_beta.ring_allreduce(p, 4 * c, a, 1 / b) * 2
            > alpha_beta.ring_allreduce(p, 4 * m, a, 1 / b)))
    with pytest.raises(ExerciseFailed, match=r"ring_reduce_scatter \(it holds the answer\) is switched off"):
        from course_lib.costs import alpha_beta as ab
        check_powersgd_crossover(lambda a, b, m, c: next(       # the ring all-reduce in its two halves
            p for p in range(2, 10**6)
            if 2 * (ab.ring_reduce_scatter(p, 2 * c, a, 1 / b) + ab.ring_all_gather(p, 2 * c, a, 1 / b))
            > ab.ring_reduce_scatter(p, 4 * m, a, 1 / b) + ab.ring_all_gather(p, 4 * m, a, 1 / b)))
    with pytest.raises(ExerciseFailed, match="numbers where the formula wants bytes"):
        check_powersgd_crossover(lambda a, b, m, c: max(2, math.floor((m - c) / (a * b)) + 1))
    with pytest.raises(ExerciseFailed, match="PowerSGD still sends its own bytes"):
        check_powersgd_crossover(lambda a, b, m, c: max(2, math.floor(4 * m / (a * b)) + 1))
    with pytest.raises(ExerciseFailed, match="return a whole number of workers"):
        check_powersgd_crossover(lambda a, b, m, c: 4 * (m - c) / (a * b))
    with pytest.raises(ExerciseFailed, match="not slower yet") as e:
        check_powersgd_crossover(lambda a, b, m, c: 2)                     # latency alone: PowerSGD always slower
    assert "264" not in str(e.value)

