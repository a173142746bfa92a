"""Sequence parallelism (Korthikanti et al. 2022, section 4.2.2): g and g-bar as autograd Functions and the Linear fused
with g give a block's outputs and gradients equal to one process's, in float64 to what reordering allows
(training/tolerance.py); what each rank keeps for backward, counted with saved-tensor hooks, equals the formulas;
the collectives are the ones the paper names."""

import matplotlib
import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib import run
from course_lib.measure.comm_log import CommLog
from course_lib.training.sequence_parallel import gather_linear, gather_tokens, reduce_scatter_tokens, scatter_tokens
from course_lib.training.tolerance import max_diff, sum_atol

matplotlib.use("Agg")

S, D, HID = 16, 8, 32           # tokens, width, hidden: notebook 13's section 7


def _block():
    torch.manual_seed(0)
    norm, fc1, fc2 = nn.LayerNorm(D).double(), nn.Linear(D, HID).double(), nn.Linear(HID, D).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5), norm.bias.uniform_(-0.5, 0.5)
    return norm, fc1, fc2, torch.randn(S, D, dtype=torch.float64)


def _saved_bytes(forward, params):
    weights = {q.untyped_storage().data_ptr() for q in params}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return out, sum(saved.values())


def _sp(keep_own_tokens):
    """On every rank: x + fc2(relu(fc1(norm(x)))) with tokens split, g before fc1 and g-bar after fc2."""
    rank, p = dist.get_rank(), dist.get_world_size()
    norm, fc1, fc2, x = _block()
    s, t = slice(rank * HID // p, (rank + 1) * HID // p), slice(rank * S // p, (rank + 1) * S // p)
    w1, b1, w2 = fc1.weight[s], fc1.bias[s], fc2.weight[:, s]
    x_in = x[t].clone().requires_grad_()

    def forward():
        ln = norm(x_in)
        h = gather_linear(ln, w1, b1) if keep_own_tokens else gather_tokens(ln) @ w1.T + b1
        return x_in + scatter_tokens(torch.relu(h) @ w2.T) + fc2.bias

    with CommLog() as fwd:
        y, kept = _saved_bytes(forward, [*norm.parameters(), *fc1.parameters(), *fc2.parameters()])
    with CommLog() as bwd:
        (y ** 2).sum().backward()
    partial = torch.cat([norm.weight.grad, norm.bias.grad, fc2.bias.grad])
    dist.all_reduce(partial)                    # the LayerNorm's and the row bias's gradients: partial sums
    return dict(y=y.detach(), gx=x_in.grad, g1=fc1.weight.grad[s], gb1=fc1.bias.grad[s], g2=fc2.weight.grad[:, s],
                partial=partial, kept=kept, fwd=[(c.op, c.size) for c in fwd.calls],
                bwd=[(c.op, c.size) for c in bwd.calls])


def _reference():
    norm, fc1, fc2, x = _block()
    x.requires_grad_()
    y, kept = _saved_bytes(lambda: x + fc2(torch.relu(fc1(norm(x)))),
                           [*norm.parameters(), *fc1.parameters(), *fc2.parameters()])
    (y ** 2).sum().backward()
    return dict(y=y.detach(), gx=x.grad, g1=fc1.weight.grad, gb1=fc1.bias.grad, g2=fc2.weight.grad,
                partial=torch.cat([norm.weight.grad, norm.bias.grad, fc2.bias.grad]), kept=kept)


def _largest_sum_of_sizes() -> float:
    """The largest Σ|terms| of any sum in the block's forward and backward ((y**2).sum() loss): what bounds how far a
    reordering moves it (Higham 2002, section 4.2). Notebook 13 states it is below 200."""
    norm, fc1, fc2, x = _block()
    w1, b1, w2, b2 = (q.detach().abs() for q in (fc1.weight, fc1.bias, fc2.weight, fc2.bias))
    ln = norm(x).detach()
    h = torch.relu(fc1(ln)).detach()
    gy = 2 * (x + fc2(h)).detach().abs()
    g_ln = (gy @ w2) @ w1
    x_hat = ((x - x.mean(1, keepdim=True)) / x.std(1, unbiased=False, keepdim=True)).abs()
    sizes = [ln.abs() @ w1.T + b1, h @ w2.T + b2, gy @ w2, gy.T @ h, gy.sum(0), (gy @ w2).T @ ln.abs(), g_ln,
             (g_ln * x_hat).sum(0), g_ln.sum(0), x.abs().sum(1), (g_ln * norm.weight.detach().abs()).sum(1)]
    return max(t.max().item() for t in sizes)


@pytest.fixture(scope="module")
def runs():
    return {(p, keep): run(_sp, world_size=p, args=(keep,), output="none", timeout=60).values
            for p in (2, 4) for keep in (False, True)}


def test_sp_outputs_and_every_gradient_equal_one_process(runs):
    ref = _reference()
    largest = _largest_sum_of_sizes()
    assert largest < 200                         # what notebook 13's TOL64 assumes
    tol = 4 * sum_atol(terms=HID, total=largest, dtype=torch.float64)
    for (p, _), vals in runs.items():
        k, n = S // p, HID // p
        for r, v in enumerate(vals):
            mine, feats = slice(r * k, (r + 1) * k), slice(r * n, (r + 1) * n)
            assert max_diff(v["y"], ref["y"][mine]) <= tol and max_diff(v["gx"], ref["gx"][mine]) <= tol
            assert max_diff(v["g1"], ref["g1"][feats]) <= tol and max_diff(v["gb1"], ref["gb1"][feats]) <= tol
            assert max_diff(v["g2"], ref["g2"][:, feats]) <= tol and max_diff(v["partial"], ref["partial"]) <= tol


def test_g_and_g_bar_run_the_papers_collectives_and_the_same_bytes_as_an_all_reduce(runs):
    act = S * D * 8                              # one float64 activation of every token
    for (_, keep), vals in runs.items():
        for v in vals:
            assert v["fwd"] == [("all_gather", act), ("reduce_scatter", act)]
            # g-bar's backward all-gathers, then g's backward reduce-scatters (with gather_linear: all-gathers again)
            extra = [("all_gather", act)] if keep else []
            assert v["bwd"] == [("all_gather", act)] + extra + [("reduce_scatter", act)]


def test_what_each_rank_keeps_for_backward_matches_the_formulas(runs):
    ref = _reference()
    one = 8 * (2 * S * D + 2 * S + S * HID)        # x, LayerNorm's output, its mean and 1/std, ReLU's output
    assert ref["kept"] == one
    for (p, keep), vals in runs.items():
        want = one // p if keep else 8 * (S * D // p + 2 * S // p + S * D + S * HID // p)
        assert [v["kept"] for v in vals] == [want] * p


def _uneven():
    reduce_scatter_tokens(torch.zeros(5, 2))


def test_an_uneven_token_split_is_refused():
    with pytest.raises(Exception, match="3 does not divide 5"):
        run(_uneven, world_size=3, output="none", timeout=30)


def test_the_figure_draws_one_bar_per_layout_with_its_total():
    from course_lib.viz.sequence_parallel import plot_kept_for_backward

    kept = {"one process": {"x": 400, "h": 400}, "SP": {"x": 100, "h": 100}}
    fig = plot_kept_for_backward(kept, p=4)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert " 800 B" in texts and " 200 B" in texts and " one process / 4" in texts
    assert len(fig.axes[0].patches) == 4
