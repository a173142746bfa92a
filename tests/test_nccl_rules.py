"""NCCL-rules mode: each rule fails a violating function on gloo ranks, which plain gloo runs; obeying code is
unchanged."""

from __future__ import annotations

import time

import pytest
import torch

from course_lib import run
from course_lib.runtime.results import RankFailed

from .conftest import notebook_function


def _fails_under_rules(fn, world, rule, *, args=(), timeout=20.0, **kw):
    """Plain gloo runs fn; under the mode it fails with the rule's name in the message."""
    run(fn, world, args=args, timeout=timeout, output="none", **kw)
    with pytest.raises(RankFailed) as info:
        run(fn, world, args=args, timeout=timeout, output="none", nccl_rules=True, **kw)
    message = str(info.value)
    assert f"NCCL rule '{rule}'" in message, message
    assert "Fix:" in message
    return message


RING = notebook_function("""
import torch, torch.distributed as dist
def ring(batched):
    r, p = dist.get_rank(), dist.get_world_size()
    x = torch.full((4,), float(r), device=device())
    got = torch.empty(4, device=device())
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, (r - 1) % p),
                                        dist.P2POp(dist.isend, x, (r + 1) % p)])
    else:
        works = [dist.irecv(got, src=(r - 1) % p), dist.isend(x, dst=(r + 1) % p)]
    for w in works:
        w.wait()
    return got
""", "ring", device=lambda: torch.device("cpu"))


def test_a_ring_of_irecv_before_isend_is_an_nccl_deadlock_naming_the_cycle():
    start = time.monotonic()
    message = _fails_under_rules(RING, 3, "p2p-order", args=(False,), timeout=20.0)
    assert time.monotonic() - start < 20.0  # within the launch's timeout, not at it
    assert "would deadlock on NCCL" in message
    for r, left in ((0, 2), (1, 0), (2, 1)):
        assert f"rank {r} waits in dist.irecv(src={left})" in message
    assert "(ring, line 11)" in message  # the learner's line that posted the receive (the source starts with "\n")


def test_the_same_ring_with_batch_isend_irecv_passes_with_the_same_numbers():
    plain = run(RING, 3, args=(True,), output="none").values
    ruled = run(RING, 3, args=(True,), output="none", nccl_rules=True).values
    assert [t.tolist() for t in plain] == [t.tolist() for t in ruled] == [[2.0] * 4, [0.0] * 4, [1.0] * 4]


SEND_THEN_COLLECTIVE = notebook_function("""
import torch, torch.distributed as dist
def f():
    x = torch.ones(2, device=device())
    if dist.get_rank() == 0:
        w = dist.isend(x, 1)
        dist.all_reduce(x)
        w.wait()
    else:
        dist.all_reduce(x)
        dist.recv(x, 0)
    return x
""", "f", device=lambda: torch.device("cpu"))


def test_a_collective_behind_an_unmatched_send_is_a_deadlock_too():
    message = _fails_under_rules(SEND_THEN_COLLECTIVE, 2, "p2p-order")
    assert "waits in dist.all_reduce" in message and "waits in dist.isend(dst=1)" in message


FIRST_BATCH = notebook_function("""
import torch, torch.distributed as dist
def f():
    r = dist.get_rank()
    x = torch.full((2,), float(r), device=device())
    if r < 2:
        got = torch.empty(2, device=device())
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1 - r), dist.P2POp(dist.irecv, got, 1 - r)]):
            w.wait()
    dist.all_reduce(x)
    return x
""", "f", device=lambda: torch.device("cpu"))


def test_a_first_batch_without_every_rank_of_the_group_is_refused():
    message = _fails_under_rules(FIRST_BATCH, 3, "first-batch")
    assert "rank 2 made dist.all_reduce first" in message


BAND = notebook_function("""
import torch, torch.distributed as dist
def f():
    x = torch.tensor([3, 5], device=device())
    dist.all_reduce(x, op=dist.ReduceOp.BAND)
    return x
""", "f", device=lambda: torch.device("cpu"))


def test_bitwise_reductions_are_refused():
    assert "ReduceOp.BAND" in _fails_under_rules(BAND, 2, "reduce-op")


ANY_SOURCE = notebook_function("""
import torch, torch.distributed as dist
def f():
    x = torch.zeros(2, device=device())
    if dist.get_rank() == 0:
        dist.send(x + 1, dst=1)
    else:
        return dist.recv(x)
""", "f", device=lambda: torch.device("cpu"))


def test_a_receive_from_any_source_is_refused():
    _fails_under_rules(ANY_SOURCE, 2, "any-source")


HOST = notebook_function("""
import torch, torch.distributed as dist
def f(moved):
    t = torch.ones(3) * (dist.get_rank() + 1)
    if moved:
        t = t.to(device())
    dist.all_reduce(t)
    return t
""", "f", device=lambda: torch.device("cpu"))


def test_a_tensor_made_on_the_cpu_is_refused_naming_where_it_was_made():
    message = _fails_under_rules(HOST, 2, "host-tensor", args=(False,))
    assert "torch.ones(...) in f, line 4" in message


def test_a_tensor_moved_to_the_ranks_device_passes_with_the_same_numbers():
    plain = run(HOST, 2, args=(True,), output="none").values
    ruled = run(HOST, 2, args=(True,), output="none", nccl_rules=True).values
    assert [t.tolist() for t in plain] == [t.tolist() for t in ruled] == [[3.0] * 3] * 2
    assert all(type(t) is torch.Tensor for t in ruled)  # the mode's marks never reach the notebook


INT16 = notebook_function("""
import torch, torch.distributed as dist
def f():
    x = torch.ones(2, dtype=torch.int16, device=device())
    dist.all_reduce(x)
""", "f", device=lambda: torch.device("cpu"))


def test_a_dtype_nccl_has_no_type_for_is_named():
    # gloo refuses int16 as well, but only as "Invalid scalar type"; the mode says what NCCL would say and why.
    with pytest.raises(RankFailed) as info:
        run(INT16, 2, output="none", nccl_rules=True)
    assert "NCCL rule 'dtype'" in str(info.value) and "int16" in str(info.value)


MONITORED = notebook_function("""
import torch.distributed as dist
def f(own_group):
    group = dist.new_group(backend="gloo") if own_group else None
    dist.monitored_barrier(group)
""", "f")


def test_monitored_barrier_is_refused_unless_on_a_gloo_group_made_for_it():
    _fails_under_rules(MONITORED, 2, "monitored-barrier", args=(False,))
    run(MONITORED, 2, args=(True,), output="none", nccl_rules=True)


TAGS = notebook_function("""
import torch, torch.distributed as dist
def f():
    a, b = torch.zeros(1, device=device()), torch.zeros(1, device=device())
    if dist.get_rank() == 0:
        works = [dist.isend(a + 1, 1, tag=1), dist.isend(b + 2, 1, tag=2)]
    else:
        works = [dist.irecv(b, 0, tag=2), dist.irecv(a, 0, tag=1)]
    for w in works:
        w.wait()
    return a, b
""", "f", device=lambda: torch.device("cpu"))


def test_messages_told_apart_by_tag_are_refused():
    message = _fails_under_rules(TAGS, 2, "tags")
    assert "tag=2" in message and "tag=1" in message


OBEYS = notebook_function("""
import torch, torch.distributed as dist
def f():
    r, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(r)
    x = torch.randn(5, generator=g).to(device())
    dist.all_reduce(x)
    parts = [torch.empty(5, device=device()) for _ in range(p)]
    dist.all_gather(parts, x * r)
    if r % 2 == 0:
        dist.send(x, (r + 1) % p)
        dist.recv(x, (r - 1) % p)
    else:
        y = torch.empty(5, device=device())
        dist.recv(y, (r - 1) % p)
        dist.send(x, (r + 1) % p)
        x = y
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    whole = torch.empty(5 * p, device=device())
    dist.all_gather_single(whole, x)              # torch 2.13's names for the single-tensor forms
    piece = torch.empty(5, device=device())
    dist.reduce_scatter_single(piece, whole)
    dist.reduce_scatter_tensor(piece, whole * 2)  # calls reduce_scatter_single inside: checked once, no self-wait
    objs = [None] * p
    dist.all_gather_object(objs, {"rank": r})
    return x + piece, torch.stack(parts), objs
""", "f", device=lambda: torch.device("cpu"))


def test_code_that_obeys_the_rules_gets_the_same_results_with_and_without_the_mode():
    plain = run(OBEYS, 4, output="none").values
    ruled = run(OBEYS, 4, output="none", nccl_rules=True).values
    for (x0, p0, o0), (x1, p1, o1) in zip(plain, ruled):
        assert torch.equal(x0, x1) and torch.equal(p0, p1) and o0 == o1  # the same calls in the same order


def test_the_environment_switch_respects_a_launch_that_chose_gloo(monkeypatch):
    monkeypatch.setenv("COURSE_NCCL_RULES", "1")
    with pytest.raises(RankFailed, match="NCCL rule 'host-tensor'"):
        run(HOST, 2, args=(False,), output="none")
    run(HOST, 2, args=(False,), output="none", backend="gloo")  # gloo-only by design: left alone


def test_a_learners_own_init_process_group_comes_under_the_rules_unless_it_names_gloo():
    own = notebook_function("""
import torch, torch.distributed as dist
def f(backend):
    dist.init_process_group(backend)  # None: torch picks NCCL for GPU tensors on a GPU machine, gloo here
    t = torch.ones(2)
    dist.all_reduce(t)
""", "f")
    run(own, 2, args=(None,), init=False, output="none")
    with pytest.raises(RankFailed, match="NCCL rule 'host-tensor'"):
        run(own, 2, args=(None,), init=False, output="none", nccl_rules=True)
    run(own, 2, args=("gloo",), init=False, output="none", nccl_rules=True)


def test_persistent_ranks_take_the_rules_too():
    from course_lib.runtime.cell_result import CellFailed
    from course_lib.runtime.persistent_ranks import Ranks

    group = Ranks(2, nccl_rules=True, timeout=20).start()
    try:
        with pytest.raises(CellFailed, match="NCCL rule 'host-tensor'"):
            group.run_cell("t = torch.ones(2)\ndist.all_reduce(t)")
    finally:
        group.stop()


def _course_p2p_algorithms():
    """Every algorithm the course builds from send/recv, as the notebooks call them (what the mode first found)."""
    import torch.distributed as dist

    from course_lib import device
    from course_lib.collectives import ALL_REDUCE, ring_all_gather, ring_reduce_scatter
    from course_lib.training.gossip import gossip_round
    from course_lib.training.pipeline import pipeline_train
    from course_lib.training.ring_attention import attention, positions, ring_attention

    r, p = dist.get_rank(), dist.get_world_size()
    out = {name: fn(torch.arange(7.0, device=device()) * (r + 1)) for name, fn in ALL_REDUCE.items()}
    out["reduce_scatter"] = ring_reduce_scatter(torch.arange(9.0, device=device()) * (r + 1)).clone()
    out["all_gather"] = ring_all_gather(torch.full((2,), float(r), device=device()))
    out["gossip"] = gossip_round(torch.full((3,), float(r), device=device()), "ring")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mine = positions(r, p, 12)
    got = ring_attention(*(t[mine].to(device()) for t in (q, k, v))).cpu()
    out["ring_attention"] = got - attention(q, k, v)[mine]
    out["pipeline"] = {name: pipeline_train(name, steps=1, m=4)["params"] for name in ("gpipe", "1f1b")}
    return out


def test_the_courses_own_point_to_point_algorithms_keep_the_rules():
    # Before the mode, the ring, gossip, ring attention and the pipelines posted isend and irecv unbatched, or sent
    # activations and gradients on one group: each of these failed here with 'p2p-order'.
    plain = run(_course_p2p_algorithms, 3, output="none", timeout=60).values
    ruled = run(_course_p2p_algorithms, 3, output="none", timeout=60, nccl_rules=True).values
    for a, b in zip(plain, ruled):
        for name in ("ring", "tree", "recursive_doubling", "star", "reduce_scatter", "all_gather", "gossip"):
            assert torch.equal(a[name], b[name]), name   # the same calls in the same order: the same bits
        assert torch.equal(a["ring"], torch.arange(7.0) * 6)
        assert b["ring_attention"].abs().max() < 1e-12   # float64 against one-process attention
        for name in ("gpipe", "1f1b"):
            assert torch.equal(a["pipeline"][name], b["pipeline"][name])


def test_a_cycle_stopped_in_persistent_ranks_marks_the_group_broken():
    from course_lib.runtime.cell_result import CellFailed
    from course_lib.runtime.persistent_ranks import Ranks

    group = Ranks(2, nccl_rules=True, timeout=20).start()
    try:
        cell = ("x, got = torch.ones(2, device=device), torch.empty(2, device=device)\n"
                "ws = [dist.irecv(got, 1 - rank), dist.isend(x, 1 - rank)]\n")
        with pytest.raises(CellFailed, match="NCCL rule 'p2p-order'"):
            group.run_cell(cell)
        assert "still pending in gloo" in group.broken or "left sends or receives posted" in group.broken
    finally:
        group.stop()


def test_the_deadlock_of_exercise_4_1_is_reported_as_a_cycle_without_its_fix():
    from course_lib.checks.core import ExerciseFailed
    from course_lib.checks.primitives import check_ring_exchange

    original = notebook_function("""
import torch, torch.distributed as dist
def ring_exchange(t):
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(t)
    dist.send(t, dst=(rank + 1) % world)
    dist.recv(got, src=(rank - 1) % world)
    return got
""", "ring_exchange")
    with pytest.raises(ExerciseFailed) as info:
        check_ring_exchange(original)
    message = str(info.value)
    assert "rank 0 waits in dist.send(dst=1)" in message and "rank 1 waits in dist.send(dst=0)" in message
    assert "which is itself waiting" in message
    # the checker keeps the rule and the cycle, never the rule's fix (the exercise's answer)
    assert "Fix:" not in message and "batch_isend_irecv" not in message and "even ranks" not in message


EVERY_COLLECTIVE = notebook_function("""
import torch, torch.distributed as dist
def every_collective(async_op):
    p, r = dist.get_world_size(), dist.get_rank()
    t = torch.arange(4 * p, dtype=torch.float32, device=device()) + r
    outs = {}
    calls = {
        "all_reduce": lambda: dist.all_reduce(outs.setdefault("all_reduce", t.clone()), async_op=async_op),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            outs.setdefault("reduce_scatter_tensor", torch.empty(4, device=device())), t, async_op=async_op),
        "reduce_scatter": lambda: dist.reduce_scatter(
            outs.setdefault("reduce_scatter", torch.empty(4, device=device())), list(t.chunk(p)), async_op=async_op),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            outs.setdefault("all_gather_into_tensor", torch.empty(4 * p * p, device=device())), t, async_op=async_op),
        "all_to_all_single": lambda: dist.all_to_all_single(
            outs.setdefault("all_to_all_single", torch.empty(4 * p, device=device())), t, async_op=async_op),
        "broadcast": lambda: dist.broadcast(outs.setdefault("broadcast", t.clone()), 0, async_op=async_op),
    }
    works = [fn() for fn in calls.values()]       # one after the other, as a training step issues them
    for w in works:
        if w is not None:
            w.wait()
    return {k: v.tolist() for k, v in outs.items()}
""", "every_collective", device=lambda: torch.device("cpu"))


@pytest.mark.parametrize("async_op", [False, True])
def test_every_wrapped_collective_completes_under_the_mode_with_the_same_numbers(async_op):
    # gloo's reduce-scatter works report is_completed() only once waited for: the mode's issue-order emulation
    # once polled them for ever (a notebook's dist.reduce_scatter_tensor hung on every rank)
    plain = run(EVERY_COLLECTIVE, 3, args=(async_op,), timeout=30, output="none").values
    ruled = run(EVERY_COLLECTIVE, 3, args=(async_op,), timeout=30, output="none", nccl_rules=True).values
    assert ruled == plain


def test_the_mode_wraps_every_tensor_collective_of_the_one_operator_table():
    # The mode's list of wrapped functions is its own (the runtime imports no instrument), so it must not drift from
    # measure/c10d_ops.py: every public tensor collective of torch.distributed there, plus barrier (issue order).
    import torch.distributed as dist

    from course_lib.measure.c10d_ops import ALL_COLLECTIVES, COLLECTIVES
    from course_lib.runtime import nccl_rules

    table = {n for c in ALL_COLLECTIVES for n in COLLECTIVES[c][0]
             if hasattr(dist, n) and "object" not in n and not n.startswith("_")}
    assert set(nccl_rules._COLLECTIVES) == table | {"barrier"}
