"""ZeRO stages 0-3 with Adam by hand and FSDP2 with torch.optim.Adam: same weights as single-process Adam at 2, 3
(uneven shards) and 4 ranks (in float64, to tolerance.adam_atol: float32 rounding through Adam's division by √v̂ + ε
can move a weight as far as Adam's own step); bytes held per rank and bytes sent per step equal to the formulas,
padding included (torch's Adam keeps FSDP2's state unpadded: zero.held_by_fsdp2)."""

import math

import pytest
import torch

from course_lib.measure.memory import SCHEMES, held_bytes, pad_bytes, per_rank_bytes
from course_lib.training.adam import adam_step, train_single_adam
from course_lib.training.tolerance import adam_atol, max_diff
from course_lib.training.zero import held_by_fsdp2, my_rows, pad, real_rows, ring_bytes_formula, run_schemes, zero_train

STEPS, BATCH, HIDDEN = 3, 16, 32      # hidden 32: a 10-row last layer does not split evenly over 3 or 4 ranks


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda p: f"p={p}")
def runs(request):
    """float32 (bytes, traffic) and the float64 rerun (weights) of every scheme, in one launch as notebook 12 runs
    them (test_float64_rerun_equals_a_launch_of_its_own: the first run leaves nothing behind that changes it)."""
    p = request.param
    out, exact = run_schemes(p, steps=STEPS, batch_size=BATCH, hidden=HIDDEN, float64_rerun=True, timeout=120)
    return p, out, exact


def test_every_scheme_ends_with_single_process_adam_weights(runs):
    p, _, out = runs
    ref, ref_losses = train_single_adam(p, STEPS, BATCH, hidden=HIDDEN, dtype=torch.float64)
    tol = adam_atol(STEPS, 1e-3, p * BATCH, HIDDEN)
    assert set(out) == set(SCHEMES)
    for scheme, ranks in out.items():
        for r, v in enumerate(ranks):
            assert v["params"].dtype == torch.float64 and max_diff(v["params"], ref) <= tol, f"{scheme} rank {r}"
        # each rank's loss is its own batch's mean: their mean is the combined batch's, up to float64 rounding
        mean_loss = [sum(v["losses"][s] for v in ranks) / p for s in range(STEPS)]
        assert mean_loss == pytest.approx(ref_losses, abs=1e-12), scheme
    assert max_diff(ref, train_single_adam(p, 0, BATCH, hidden=HIDDEN, dtype=torch.float64)[0]) > 1e-3   # it learned


def test_float64_rerun_equals_a_launch_of_its_own():
    schemes, kw = ("ZeRO-2", "ZeRO-3", "FSDP2"), dict(steps=STEPS, batch_size=BATCH, hidden=HIDDEN, timeout=120)
    alone = run_schemes(2, schemes, dtype=torch.float64, comm_log=False, **kw)
    _, rerun = run_schemes(2, schemes, float64_rerun=True, **kw)
    for s in schemes:
        for a, b in zip(alone[s], rerun[s]):
            assert torch.equal(a["params"], b["params"]) and a["losses"] == b["losses"], s


def test_memory_measured_equals_formula(runs):
    p, out, _ = runs
    for scheme, ranks in out.items():
        shapes = ranks[0]["shapes"]
        for r, v in enumerate(ranks):
            want = held_by_fsdp2(shapes, p, r) if scheme == "FSDP2" else per_rank_bytes(scheme, shapes, p)
            assert v["memory"] == want, f"{scheme} rank {r}"
    # FSDP2's first rank holds full shards, so the padded formula; a last rank with fewer real rows holds less
    f2 = [v["memory"]["optimizer"] for v in out["FSDP2"]]
    assert f2[0] == per_rank_bytes("FSDP2", out["FSDP2"][0]["shapes"], p)["optimizer"]
    assert (f2[-1] < f2[0]) == (p in (3, 4))
    dp, z3 = out["DP"][0]["memory"]["total"], out["ZeRO-3"][0]["memory"]["total"]
    shapes = out["DP"][0]["shapes"]
    assert z3 * p == dp + pad_bytes("ZeRO-3", shapes, p)               # 16Ψ over p ranks, plus padding rows
    assert (pad_bytes("ZeRO-3", shapes, p) > 0) == (p in (3, 4))        # 10 rows over 3 or 4 ranks need padding


def test_traffic_measured_equals_formula(runs):
    p, out, _ = runs
    for scheme, ranks in out.items():
        want = ring_bytes_formula(scheme, ranks[0]["shapes"], p)
        for v in ranks:
            for step in v["traffic"]:
                assert step["total"]["ring_bytes"] == pytest.approx(want, rel=1e-12), scheme
    ops = {s: {k for k in out[s][0]["traffic"][0] if k != "total"} for s in SCHEMES}
    assert ops["DP"] == {"all_reduce"}
    assert all(ops[s] == {"reduce_scatter", "all_gather"} for s in SCHEMES[1:])
    for s in ("ZeRO-3", "FSDP2"):                       # two all-gathers (forward, backward) per reduce-scatter
        t = out[s][0]["traffic"][0]
        assert t["all_gather"]["bytes"] == 2 * t["reduce_scatter"]["bytes"]
    assert out["FSDP2"][0]["traffic"][0]["total"]["calls"] == 9      # one unit per Linear: 3 x (AG, AG, RS)
    assert out["ZeRO-3"][0]["traffic"][0]["total"]["calls"] == 18    # ours: weight and bias separately


def test_stage3_holds_one_gathered_layer_at_a_time(runs):
    p, out, _ = runs
    shapes = out["ZeRO-3"][0]["shapes"]
    layers = [(math.ceil(w[0] / p) * p) * (w[1] + 1) * 4 for w in shapes[::2]]    # padded weight + bias bytes
    assert all(v["gathered_peak"] == max(layers) for v in out["ZeRO-3"])


def test_formulas_reproduce_zero_paper_figure_1():
    # Rajbhandari et al. SC'20, figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12)
    got = [per_rank_bytes(s, 7.5e9, 64, "mixed")["total"] / 1e9 for s in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]
    assert per_rank_bytes("DP", 175e9, 1, "mixed")["total"] == 2.8e12


def test_adam_step_equals_torch_adam():
    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)
    mine, m, v = w.detach().clone(), torch.zeros(5, 3), torch.zeros(5, 3)
    opt = torch.optim.Adam([w], lr=0.01)
    for t in range(1, 4):
        g = torch.randn(5, 3)
        w.grad = g.clone()
        opt.step()
        adam_step(mine, g, m, v, t, 0.01)
    assert torch.allclose(mine, w.detach(), atol=1e-7)


def test_real_rows_add_up_to_the_tensor_and_sit_first():
    for rows in (1, 2, 10, 32, 256):
        for p in (1, 2, 3, 4, 5):
            got = [real_rows(rows, p, r) for r in range(p)]
            assert sum(got) == rows and got == sorted(got, reverse=True), (rows, p, got)
    assert [real_rows(10, 4, r) for r in range(4)] == [3, 3, 3, 1]
    assert [real_rows(2, 4, r) for r in range(4)] == [1, 1, 0, 0]


def test_row_shards_cover_the_padded_tensor():
    t = torch.arange(30.0).reshape(10, 3)
    shards = [my_rows(t, 4, r) for r in range(4)]
    assert all(s.shape == (3, 3) for s in shards)
    assert torch.equal(torch.cat(shards), pad(t, 4)) and torch.equal(pad(t, 4)[10:], torch.zeros(2, 3))
    assert held_bytes([shards[0], shards[0][1:], None]) == 9 * 4       # a view shares its storage: counted once


def test_bad_stage_or_scheme_is_refused_before_launch():
    with pytest.raises(ValueError, match="stage must be one of"):
        zero_train(4)                                   # raises before touching the process group
    with pytest.raises(ValueError, match="unknown scheme"):
        run_schemes(2, ["ZeRO-4"], steps=1)
