"""Mixture of experts and expert parallelism (notebook 15): routing with a capacity; the expert-parallel forward
equal to the single-process layer (float64, to the reordering bound of training/tolerance.py) on 4 ranks holding
20-35 tokens, top-1 and top-2, with and without capacity, one and two experts per rank (the exchange checker's test
covers 2 and 3 ranks); the bytes each
all-to-all moved equal the formula exactly; the load-balancing loss balancing a router; and the checker of the
exchange's backward (exercise 15.2) accepting two correct backwards and rejecting torch's own (each road named as
what it is), the course's own exchange, a split one, a padded one (right gradients, wrong traffic) and a wrong one
with a message that says what is wrong; and the expert-parallel layer on a 2 x 2 ("edp", "ep") mesh training to the
weights of single-process SGD, with its all-reduces in the groups section 4 of the notebook names."""

import pytest
import torch
import torch.distributed as dist

from course_lib import run
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.expert_parallel import check_exchange
from course_lib.measure.alltoall_log import AllToAllLog
from course_lib.training.moe import MoE, aux_loss, capacity, ep_bytes_formula, ep_forward, experts_of, route
from course_lib.training.tolerance import max_diff, sgd_atol, sum_atol
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


# the same shortcut by torch's autograd.Function itself, by the functional collectives (differentiable in torch 2.13),
# reached by name or as the bare operator, and by the course's own exchange
AUTOGRAD_FN = """
class Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits):
        from torch.distributed.nn.functional import _AlltoAllSingle
        out = rows.new_empty(sum(out_splits), rows.shape[1])
        return _AlltoAllSingle.apply(dist.group.WORLD, out, out_splits, in_splits, rows.contiguous())
"""
FUNCTIONAL = """
class Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits):
        from torch.distributed._functional_collectives import all_to_all_single
        return all_to_all_single(rows.contiguous(), out_splits, in_splits, dist.group.WORLD).wait()
"""
# (getattr: a cell that names torch.ops outright cannot be sent to the ranks, since cloudpickle cannot pickle it)
OPERATOR = """
class Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        c10d = getattr(torch, "ops")._c10d_functional
        out = c10d.all_to_all_single(rows.contiguous(), out_splits, in_splits, dist.group.WORLD.group_name)
        return c10d.wait_tensor(out)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        c10d = getattr(torch, "ops")._c10d_functional
        back = c10d.all_to_all_single(grad.contiguous(), in_splits, out_splits, dist.group.WORLD.group_name)
        return c10d.wait_tensor(back), None, None
"""
LIBRARY = """
class Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits):
        from course_lib.training.moe import _exchange
        ctx.splits = (out_splits, in_splits)
        return _exchange(rows, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        from course_lib.training.moe import _exchange
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits), None, None
"""
# right numbers, wrong method: every block padded to 16 rows and exchanged with equal splits, forward and backward
PADDED = """
def padded(rows, out_splits, in_splits, pad=16):
    p = len(in_splits)
    send = rows.new_zeros(p * pad, rows.shape[1])
    for j, (start, n) in enumerate(zip([0, *torch.tensor(in_splits).cumsum(0).tolist()], in_splits)):
        send[j * pad:j * pad + n] = rows[start:start + n]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return torch.cat([recv[j * pad:j * pad + n] for j, n in enumerate(out_splits)])

class Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        return padded(rows, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return padded(grad, in_splits, out_splits), None, None
"""


def test_exchange_checker_accepts_correct_backwards_and_names_what_is_wrong(capsys):
    g = {"torch": torch, "dist": dist}
    for src in (RIGHT, RECURSIVE):
        check_exchange(notebook_function(src, "Exchange", **g))
        assert "✓ Exercise 15.2" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match=r"is about the exchange's backward; torch's differentiable all-to-all "
                                             r"\(torch.distributed.nn.functional's or _functional_collectives' "
                                             r"all_to_all_single\) is switched off"):
        check_exchange(notebook_function(TORCHS, "Exchange", **g))
    with pytest.raises(ExerciseFailed, match=r"torch.distributed.nn.functional._AlltoAllSingle \(torch's "
                                             r"differentiable all-to-all\) is switched off"):
        check_exchange(notebook_function(AUTOGRAD_FN, "Exchange", **g))
    with pytest.raises(ExerciseFailed, match=r"_functional_collectives' all_to_all_single\) is switched off"):
        check_exchange(notebook_function(FUNCTIONAL, "Exchange", **g))
    with pytest.raises(ExerciseFailed, match=r"reached torch's functional all_to_all_single"):
        check_exchange(notebook_function(OPERATOR, "Exchange", **g))
    with pytest.raises(ExerciseFailed, match=r"the course's own training.moe._exchange \(it holds the answer\)"):
        check_exchange(notebook_function(LIBRARY, "Exchange", **g))
    with pytest.raises(ExerciseFailed, match=r"as the dispatch, sent \[512, 512\] bytes .* no padding"):
        check_exchange(notebook_function(PADDED, "Exchange", **g))
    with pytest.raises(ExerciseFailed, match=r"backward made 4 all_to_all_single calls for the layer's 2 exchanges"):
        check_exchange(notebook_function(TWICE, "Exchange", **g))
    with pytest.raises(ExerciseFailed, match=r"2 ranks, rank \d: the gradient of this rank's tokens is off by"):
        check_exchange(notebook_function(FLIPPED, "Exchange", **g))


# ------------------------------------------------- expert parallelism beside data parallelism (notebook 15, section 5)

def _ep_tokens(rank):
    return torch.randn(24 + 4 * rank, 8, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def _ep_target(x):
    return x.flip(-1).tanh()


def _ep_model():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8, dtype=torch.float64), MoE(k=2, n_experts=4)


def _ep_x_dp(steps, lr, n_all):
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib.measure.comm_log import CommLog
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    ep, edp = mesh["ep"].get_group(), mesh["edp"].get_group()
    below, moe = _ep_model()
    mine = experts_of(mesh["ep"].get_local_rank(), 4, 2)
    shared = [*below.parameters(), moe.gate.weight]
    local = [q for e in mine for q in moe.experts[e].parameters()]
    opt = torch.optim.SGD(shared + local, lr=lr)
    x = _ep_tokens(dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        with CommLog() as log:
            y = ep_forward(below(x), moe, group=ep,
                           exchange=lambda rows, o, i: all_to_all_single_autograd(rows, o, i, ep))
            (((y - _ep_target(x)) ** 2).sum() / n_all).backward()
            for q in shared:
                dist.all_reduce(q.grad)
            for q in local:
                dist.all_reduce(q.grad, group=edp)
        opt.step()
    params = {n: q.detach() for n, q in [*below.named_parameters(prefix="below"), *moe.named_parameters()]}
    return list(mine), params, sorted((c.op, c.p) for c in log.calls)


def test_expert_parallel_beside_data_parallel_trains_to_single_process_sgd():
    steps, lr = 3, 0.5
    n_all = sum(len(_ep_tokens(r)) for r in range(4))
    res = run(_ep_x_dp, world_size=4, args=(steps, lr, n_all), output="none", timeout=120)
    below, moe = _ep_model()
    params = [*below.parameters(), *moe.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    biggest = 0.0                    # one token's gradient entries, the `grad` of the notebook's sgd_atol (4.0)
    for _ in range(steps):
        for r in range(4):
            x = _ep_tokens(r)
            per_token = ((moe(below(x)) - _ep_target(x)) ** 2).sum(-1)
            for i in range(len(x)):
                grads = torch.autograd.grad(per_token[i], params, retain_graph=True, allow_unused=True)
                biggest = max(biggest, max(g.abs().max().item() for g in grads if g is not None))
        opt.zero_grad()
        (sum(((moe(below(_ep_tokens(r))) - _ep_target(_ep_tokens(r))) ** 2).sum() for r in range(4)) / n_all).backward()
        opt.step()
    assert biggest < 4.0 and max(q.abs().max().item() for q in params) < 1.0     # sgd_atol's assumptions
    ref = dict([*below.named_parameters(prefix="below"), *moe.named_parameters()])
    atol = sgd_atol(steps, lr, n_all, 16, torch.float64, grad=4.0)
    for rank, (mine, got, calls) in enumerate(res.values):
        assert mine == ([0, 1] if rank % 2 == 0 else [2, 3])
        held = [n for n in got if not n.startswith("experts.") or int(n.split(".")[1]) in mine]
        assert all(max_diff(got[n], ref[n]) < atol for n in held), rank
        # 5 all-to-alls inside "ep", 3 all-reduces over the world, 8 over "edp"
        assert calls == sorted([("all_to_all", 2)] * 5 + [("all_reduce", 4)] * 3 + [("all_reduce", 2)] * 8)
