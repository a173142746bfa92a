"""Mixture of experts and expert parallelism (notebook 15): routing with a capacity; the expert-parallel forward
equal to the single-process layer (float64, to the reordering bound of training/tolerance.py) on 4 ranks holding
20-35 tokens, top-1 and top-2, with and without capacity, one and two experts per rank (the exchange checker's test
covers 2 and 3 ranks); the bytes each
all-to-all moved equal the formula exactly; the load-balancing loss balancing a router; and the checker of the
exchange's backward (exercise 15.2) accepting two correct backwards and rejecting torch's own, a split one and a
wrong one with a message that says what is wrong."""

import pytest
import torch
import torch.distributed as dist

from course_lib import run
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.expert_parallel import check_exchange
from course_lib.measure.alltoall_log import AllToAllLog
from course_lib.training.moe import MoE, aux_loss, capacity, ep_bytes_formula, ep_forward, experts_of, route
from course_lib.training.tolerance import max_diff, sum_atol
from tests.conftest import notebook_function

CASES = [(1, 1.0, 4), (2, 1.25, 4), (1, None, 4), (2, 1.0, 8)]   # (k, capacity factor, experts): 1 or 2 per rank


def _tokens(rank, d=8):
    return torch.randn(20 + 5 * rank, d, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64)


def _ep():
    out = []
    for k, cf, e in CASES:
        layer = MoE(k=k, capacity_factor=cf, n_experts=e)
        with AllToAllLog() as log:
            y = ep_forward(_tokens(dist.get_rank()), layer)
        out.append((y, log.sent, log.received, [c.to for c in log.calls]))
    return out


def test_routing_serves_first_choices_first_and_drops_over_capacity():
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 0.0, 4.0], [5.0, 4.0, 0.0], [0.0, 5.0, 4.0]])
    r = route(logits, k=2, capacity_factor=0.75)          # capacity ceil(0.75 * 4 * 2 / 3) = 2
    assert r.capacity == capacity(4, 3, 2, 0.75) == 2
    # first choices: e0 <- tokens 0, 1 and 2 (over capacity), e1 <- token 3; then the second choices: e1 <- token 0
    # (its 2nd), e2 <- token 1, e1 <- token 2 (over capacity: e1 is full), e2 <- token 3
    kept = sorted(zip(r.token.tolist(), r.expert.tolist()))
    assert kept == [(0, 0), (0, 1), (1, 0), (1, 2), (3, 1), (3, 2)] and r.dropped == 2
    assert torch.allclose(r.weight[:2], r.probs[[0, 1], 0] / (r.probs[[0, 1], 0] + r.probs[[0, 1], [1, 2]]))
    top1 = route(logits, k=1, capacity_factor=None)
    assert top1.dropped == 0 and torch.equal(top1.weight, top1.probs.max(-1).values)
    uniform = torch.full((6, 3), 1 / 3)
    assert aux_loss(uniform, torch.tensor([0, 1, 2, 0, 1, 2])).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        experts_of(0, 4, 3)
    torch.manual_seed(5)
    before = torch.rand(3)
    torch.manual_seed(5)
    MoE()                                                  # builds the same layer, leaves the caller's stream alone
    assert torch.equal(torch.rand(3), before)


def test_expert_parallel_forward_equals_the_layer_and_moves_the_formula_bytes():
    for p in (4,):
        res = run(_ep, world_size=p, output="none", timeout=60)
        for i, (k, cf, e) in enumerate(CASES):
            layer = MoE(k=k, capacity_factor=cf, n_experts=e)
            routings = [layer.route(_tokens(r)) for r in range(p)]
            formula = ep_bytes_formula(routings, e, 8, 8)
            for r, v in enumerate(res.values):
                y, sent, received, calls = v[i]
                # sums of <= 8 + 16 float64 products of size < 10, in another order
                assert max_diff(y, layer(_tokens(r))) < sum_atol(24, 240.0, torch.float64), (p, k, cf, r)
                assert sent == formula[r]["total"] and len(calls) == 3
                assert sum(calls[1]) - calls[1][r] == formula[r]["dispatch"]
                assert sum(calls[2]) - calls[2][r] == formula[r]["combine"]
            # every byte sent is received by someone
            assert sum(v[i][1] for v in res.values) == sum(v[i][2] for v in res.values)


def test_the_load_balancing_loss_keeps_the_router_from_collapsing():
    from course_lib.training.moe import train_router
    alone, balanced = train_router(0.0, steps=100), train_router(0.1, steps=100)
    assert max(alone["after"]) * 8 > 3 and max(balanced["after"]) * 8 < 1.5
    assert sum(balanced["after"]) == pytest.approx(1.0)


RIGHT = """
class Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        out = rows.new_empty(sum(out_splits), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None
"""

# correct, written another way: backward is the class's own forward with the splits swapped
RECURSIVE = RIGHT.replace("""        back = grad.new_empty(sum(in_splits), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None""", """        return Exchange.apply(grad, in_splits, out_splits), None, None""")
# the shortcut: torch's own differentiable all-to-all
TORCHS = """
class Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        out = rows.new_empty(sum(out_splits), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed.nn.functional as F
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), grad.shape[1])
        return F.all_to_all_single(back, grad.contiguous(), in_splits, out_splits), None, None
"""
# right numbers, wrong method: the reverse exchange in two calls (the rows' two halves of the feature dimension)
TWICE = RIGHT.replace("""        back = grad.new_empty(sum(in_splits), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None""", """        halves = []
        for part in grad.chunk(2, dim=1):
            back = part.new_empty(sum(in_splits), part.shape[1])
            dist.all_to_all_single(back, part.contiguous(), in_splits, out_splits)
            halves.append(back)
        return torch.cat(halves, 1), None, None""")
# a wrong result with the right bytes: the reverse exchange of the gradient rows in the wrong order
FLIPPED = RIGHT.replace("dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)",
                        "dist.all_to_all_single(back, grad.flip(0).contiguous(), in_splits, out_splits)")


def test_exchange_checker_accepts_correct_backwards_and_names_what_is_wrong(capsys):
    g = {"torch": torch, "dist": dist}
    for src in (RIGHT, RECURSIVE):
        check_exchange(notebook_function(src, "Exchange", **g))
        assert "✓ Exercise 15.2" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match=r"is about the exchange's backward; .*all_to_all_single is switched off"):
        check_exchange(notebook_function(TORCHS, "Exchange", **g))
    with pytest.raises(ExerciseFailed, match=r"backward made 4 all_to_all_single calls for the layer's 2 exchanges"):
        check_exchange(notebook_function(TWICE, "Exchange", **g))
    with pytest.raises(ExerciseFailed, match=r"2 ranks, rank \d: the gradient of this rank's tokens is off by"):
        check_exchange(notebook_function(FLIPPED, "Exchange", **g))
