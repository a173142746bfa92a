"""Tensor parallel (Megatron column/row split): layers and MLP equal nn.Linear / the plain MLP at 1, 2 and 4 ranks,
training equals single-process SGD (ours and DTensor's), each to what float32 summation order allows
(training/tolerance.py); traffic and memory measured equal the formulas exactly."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib import run
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.tensor_parallel import check_column_parallel_forward, check_row_parallel_linear
from course_lib.costs import hardware
from course_lib.measure.comm_log import CommLog
from course_lib.training import train_single
from course_lib.training.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelMLP,
    check_divisible,
    launch_tp_train,
    megatron_layer_cost,
    mlp_comm_formula,
    parallel_degrees,
    rank_layout,
    tp_param_bytes_formula,
)
from course_lib.training.tolerance import max_diff, sgd_atol, sum_atol

D, H, B = 8, 16, 6          # in/out features of the MLP, hidden, batch


def _plain(seed=0):
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    return mlp, torch.randn(B, D)


def _layers():
    """On every rank: each split layer, forward and backward, with the calls CommLog saw."""
    mlp, x = _plain()
    out = {}
    for name, make in [("column", lambda: ColumnParallelLinear(mlp[0])),
                       ("column_gather", lambda: ColumnParallelLinear(mlp[0], gather_output=True)),
                       ("mlp", lambda: TensorParallelMLP(mlp[0], mlp[2])),
                       ("mlp_nograd", lambda: TensorParallelMLP(mlp[0], mlp[2]))]:
        layer = make()
        xi = x.clone().requires_grad_(name != "mlp_nograd")
        with CommLog() as log:
            y = layer(xi)
            (y ** 2).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        out[name] = (y.detach(), xi.grad, grads, [(c.op, c.size, c.p) for c in log.calls])
    row = RowParallelLinear(mlp[2])                   # input already split: this rank's hidden features
    r, p = dist.get_rank(), dist.get_world_size()
    h = torch.randn(B, H, generator=torch.Generator().manual_seed(1))
    hi = h[:, r * H // p:(r + 1) * H // p].clone().requires_grad_()
    with CommLog() as log:
        y = row(hi)
        (y ** 2).sum().backward()
    out["row"] = (y.detach(), hi.grad, {n: q.grad.clone() for n, q in row.named_parameters()},
                  [(c.op, c.size, c.p) for c in log.calls])
    return out


def _reference():
    mlp, x = _plain()
    ref = {}
    for name, fwd in [("column", lambda z: mlp[0](z)), ("mlp", lambda z: mlp(z))]:
        mlp.zero_grad()
        xi = x.clone().requires_grad_()
        y = fwd(xi)
        (y ** 2).sum().backward()
        ref[name] = (y.detach(), xi.grad, {n: q.grad.clone() for n, q in mlp.named_parameters() if q.grad is not None})
    mlp.zero_grad()
    h = torch.randn(B, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
    y = mlp[2](h)
    (y ** 2).sum().backward()
    ref["row"] = (y.detach(), h.grad, {n: q.grad.clone() for n, q in mlp.named_parameters() if q.grad is not None})
    return ref


def _largest_sum_of_sizes() -> float:
    """The largest Σ|terms| of any sum in the references' forward and backward ((y**2).sum() loss): what bounds
    how much reordering that sum can change it (Higham 2002, section 4.2)."""
    mlp, x = _plain()
    w1, b1, w2, b2 = (q.detach().abs() for q in mlp.parameters())
    h = mlp[1](mlp[0](x)).detach().abs()
    gy = 2 * mlp(x).detach().abs()
    hr = torch.randn(B, H, generator=torch.Generator().manual_seed(1)).abs()      # the row test's input
    gyr = 2 * (hr @ w2.T + b2)
    sizes = [x.abs() @ w1.T + b1, h @ w2.T + b2, gy.T @ h, gy.sum(0), gy @ w2, (gy @ w2).T @ x.abs(),
             (gy @ w2) @ w1, gyr.T @ hr, gyr @ w2]
    return max(t.max().item() for t in sizes)


# Forward and backward are four rounds of sums (2 layers each way) of at most H + 1 terms, each reordered on the ranks.
TOL = 4 * sum_atol(terms=H + 1, total=_largest_sum_of_sizes())


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda p: f"p{p}")
def layers(request):
    p = request.param
    return p, run(_layers, world_size=p, output="none", timeout=60).values, _reference()


def close(a, b):
    return max_diff(a, b) <= TOL


def test_column_parallel_equals_nn_linear_slices(layers):
    p, vals, ref = layers
    y_ref, gx_ref, g_ref = ref["column"]
    k = H // p
    for r, v in enumerate(vals):
        s = slice(r * k, (r + 1) * k)
        y, gx, g, calls = v["column"]
        assert close(y, y_ref[:, s]) and close(gx, gx_ref)            # this rank's output columns
        assert close(g["weight"], g_ref["0.weight"][s]) and close(g["bias"], g_ref["0.bias"][s])
        # without the gather, the loss only sees this rank's columns: f sums every rank's partial dL/dX
        assert calls == ([] if p == 1 else [("all_reduce", B * D * 4, p)])
        y, gx, g, calls = v["column_gather"]
        assert close(y, y_ref) and close(gx, gx_ref) and close(g["weight"], g_ref["0.weight"][s])
        assert [c[0] for c in calls] == ([] if p == 1 else ["all_gather", "all_reduce"])


def test_row_parallel_equals_nn_linear_with_bias_once(layers):
    p, vals, ref = layers
    y_ref, gh_ref, g_ref = ref["row"]
    k = H // p
    for r, v in enumerate(vals):
        y, gh, g, calls = v["row"]
        assert close(y, y_ref)                                        # bias added once, after the all-reduce
        assert close(gh, gh_ref[:, r * k:(r + 1) * k])
        assert close(g["weight"], g_ref["2.weight"][:, r * k:(r + 1) * k]) and close(g["bias"], g_ref["2.bias"])
        assert calls == ([] if p == 1 else [("all_reduce", B * D * 4, p)])


def test_tp_mlp_equals_plain_mlp_and_counts_match_formula(layers):
    p, vals, ref = layers
    y_ref, gx_ref, g_ref = ref["mlp"]
    k = H // p
    for r, v in enumerate(vals):
        s = slice(r * k, (r + 1) * k)
        for name, needs in (("mlp", True), ("mlp_nograd", False)):
            y, gx, g, calls = v[name]
            assert close(y, y_ref)
            assert not needs or close(gx, gx_ref)
            assert close(g["fc1.weight"], g_ref["0.weight"][s]) and close(g["fc1.bias"], g_ref["0.bias"][s])
            assert close(g["fc2.weight"], g_ref["2.weight"][:, s]) and close(g["fc2.bias"], g_ref["2.bias"])
            want = [] if p == 1 else mlp_comm_formula(B, D, D, p, input_grad=needs)
            assert calls == want                 # g forward (B x h_out); f backward (B x h_in) only if needed


@pytest.mark.parametrize("p", [1, 2, 4])
def test_tp_train_equals_single_process_sgd_and_memory_formula(p):
    ref, ref_losses = train_single(n_workers=1, steps=4, batch_size=16, hidden=32)
    vals = launch_tp_train(p, steps=4, batch=16, hidden=32)
    tol = sgd_atol(4, 0.1, 16, 32)
    # a cross-entropy moves by at most 2 x its largest logit's change; a logit (3 layers of sums of at most 33 terms,
    # activations below 2) by at most 3 x 33 x 2 x tol
    loss_tol = 2 * 3 * 33 * 2 * tol
    for v in vals:
        assert max_diff(v["params"], ref) <= tol
        assert v["losses"] == pytest.approx(ref_losses, abs=loss_tol)
        assert v["param_bytes"] == tp_param_bytes_formula(32, p)
    # the formula itself, by hand: (64*32 + 32 + 32*32) / p split, 32 + 32*10 + 10 whole, 4 bytes each
    assert tp_param_bytes_formula(32, p) == ((64 * 32 + 32 + 32 * 32) // p + 32 + 320 + 10) * 4


def test_dtensor_training_equals_ours():
    ref, _ = train_single(n_workers=1, steps=3, batch_size=16, hidden=32)
    vals = launch_tp_train(2, steps=3, batch=16, hidden=32, impl="dtensor")
    assert all(max_diff(v["params"], ref) <= sgd_atol(3, 0.1, 16, 32) for v in vals)
    assert [v["param_bytes"] for v in vals] == [tp_param_bytes_formula(32, 2)] * 2


def _dtensor_mlp_vs_ours():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mlp, x = _plain()
    ours = TensorParallelMLP(mlp[0], mlp[2])
    parallelize_module(mlp, init_device_mesh("cpu", (dist.get_world_size(),)),
                       {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with CommLog() as log:
        y1 = mlp(x1)
        (y1 ** 2).sum().backward()
    y2 = ours(x2)
    (y2 ** 2).sum().backward()
    return (close(y1, y2) and close(x1.grad, x2.grad)
            and close(mlp[0].weight.grad.to_local(), ours.fc1.weight.grad)
            and close(mlp[2].weight.grad.to_local(), ours.fc2.weight.grad)
            and close(mlp[2].bias.grad.to_local(), ours.fc2.bias.grad)), [(c.op, c.size) for c in log.calls]


def test_dtensor_mlp_equals_ours_with_the_same_collectives():
    for same, calls in run(_dtensor_mlp_vs_ours, world_size=2, output="none", timeout=60).values:
        assert same
        assert calls == [(op, s) for op, s, _ in mlp_comm_formula(B, D, D, 2, input_grad=True)]


def test_uneven_split_is_refused_before_any_process_starts(monkeypatch):
    import course_lib.runtime.launch
    monkeypatch.setattr(course_lib.runtime.launch, "run", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match="3 does not divide 32"):
        launch_tp_train(3, hidden=32)
    assert check_divisible(32, 4) == 8


def test_gpt3_layer_cost_by_hand():
    a100, nvlink, ib = (hardware.row("accelerators", "A100 80GB SXM"), hardware.row("links", "NVLink 3 (A100)"),
                        hardware.row("links", "InfiniBand HDR"))
    s = 2048 * 12288 * 2                                                   # fp16 activation of one micro-batch
    fast = megatron_layer_cost(12288, 2048, 1, 8, nvlink, a100)
    slow = megatron_layer_cost(12288, 2048, 1, 8, ib, a100)
    assert fast["activation_bytes"] == s
    assert fast["allreduce_s"] == pytest.approx(2 * 7 * 1e-6 + 2 * 7 / 8 * s / 300e9)
    flops = 3 * 24 * 2048 * 12288 ** 2 * (1 + 2048 / (6 * 12288))
    assert fast["layer_compute_s"] == pytest.approx(flops / (8 * 312e12))
    assert fast["layer_comm_s"] == pytest.approx(4 * fast["allreduce_s"])
    assert fast["comm_over_compute"] < 0.2 < 1 < slow["comm_over_compute"]   # TP inside the NVLink node


def test_bloom_layout_keeps_every_tp_group_in_one_node():
    bloom = hardware.row("training_runs", "BLOOM-176B")
    deg = parallel_degrees(bloom["parallelism"])
    assert deg == {"data": 8, "tensor": 4, "pipeline": 12}
    assert parallel_degrees(hardware.row("training_runs", "OPT-175B")["parallelism"]) == {}   # not in the table
    layout = rank_layout(deg["data"], deg["tensor"], deg["pipeline"])
    assert len(layout) == bloom["gpus"] == 384 and layout[-1]["node"] == 47
    groups = {}
    for d in layout:
        groups.setdefault((d["stage"], d["replica"]), []).append(d)
    assert len(groups) == 96 and all(len({d["node"] for d in g}) == 1 and len(g) == 4 for g in groups.values())
    assert all(len({d["node"] for d in layout if d["stage"] == st}) == 4 for st in range(12))


def test_checkers_pass_right_answers_and_explain_wrong_ones(capsys):
    def column(x, linear):
        r, p = dist.get_rank(), dist.get_world_size()
        k = linear.out_features // p
        return x @ linear.weight[r * k:(r + 1) * k].T + linear.bias[r * k:(r + 1) * k]

    def row_bias_everywhere(x, linear):
        r, p = dist.get_rank(), dist.get_world_size()
        k = linear.in_features // p
        y = x[:, r * k:(r + 1) * k] @ linear.weight[:, r * k:(r + 1) * k].T + linear.bias
        dist.all_reduce(y)
        return y

    check_column_parallel_forward(column)
    assert "Exercise 13.1 passed" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="added on every rank"):
        check_row_parallel_linear(row_bias_everywhere)
    with pytest.raises(ExerciseFailed, match="shape"):
        check_column_parallel_forward(lambda x, linear: linear(x))


def _column_by_chunks(x, linear):       # written differently from the notebook's: F.linear on chunks
    r, p = dist.get_rank(), dist.get_world_size()
    return nn.functional.linear(x, linear.weight.chunk(p)[r], linear.bias.chunk(p)[r])


def _row_by_einsum(x, linear):
    r, p = dist.get_rank(), dist.get_world_size()
    y = torch.einsum("bi,oi->bo", x.tensor_split(p, dim=1)[r], linear.weight.tensor_split(p, dim=1)[r])
    dist.all_reduce(y)
    return y + linear.bias


def _column_whole_layer(x, linear):     # right numbers, wrong method: the whole layer on every rank
    return linear(x).chunk(dist.get_world_size(), dim=1)[dist.get_rank()]


def _row_whole_layer(x, linear):        # right numbers on a clean layer: every rank computes all of it
    y = linear(x)
    dist.all_reduce(y)
    return y / dist.get_world_size()


def test_checkers_refuse_the_whole_layer_on_every_rank(capsys):
    check_column_parallel_forward(_column_by_chunks)
    check_row_parallel_linear(_row_by_einsum)
    assert "Exercise 13.2 passed" in capsys.readouterr().out
    for checker, whole in ((check_column_parallel_forward, _column_whole_layer),
                           (check_row_parallel_linear, _row_whole_layer)):
        with pytest.raises(ExerciseFailed, match="read numbers outside this rank's slice"):
            checker(whole)
