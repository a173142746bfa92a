"""Activation memory and the layout calculator (notebook 14): bytes saved for backward = the formulas, exactly;
checkpointing keeps 2sbh per layer; the calculator reproduces the ZeRO paper's figure 1 and BLOOM-176B's run."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from course_lib.costs import hardware
from course_lib.costs import parallel_plan as pp
from course_lib.measure.activations import (
    ActivationMeter,
    TransformerLayer,
    beyond_formula,
    mlp_activation_formula,
    saved_by_layer,
    transformer_formula,
)
from course_lib.training import make_mlp
from course_lib.training.pipeline import make_deep_mlp


@pytest.mark.parametrize("batch", [1, 32])
def test_mlp_layers_keep_their_inputs_and_relu_outputs(batch):
    for model in (make_mlp(), make_deep_mlp(layers=5, hidden=64)):
        rows, total = saved_by_layer(model, torch.randn(batch, 64))
        assert [b for _, b in rows] == mlp_activation_formula(model, batch)
        assert total == sum(mlp_activation_formula(model, batch))


def test_the_meter_follows_backward_freeing_what_it_counted():
    model = make_mlp()
    with ActivationMeter() as meter:
        out = model(torch.randn(8, 64))
    assert meter.live == meter.peak == sum(mlp_activation_formula(model, 8))
    out.sum().backward()
    assert meter.live == 0


@pytest.mark.parametrize("s,b,h,a", [(16, 2, 64, 4), (32, 1, 128, 8), (8, 3, 32, 2)])
def test_transformer_layer_keeps_the_papers_bytes_plus_what_this_build_adds(s, b, h, a):
    torch.manual_seed(0)
    layer = TransformerLayer(h, a).to(torch.bfloat16)
    with ActivationMeter() as meter:
        out = layer(torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True))   # noqa: F841 (keeps the graph)
    want = transformer_formula(s, b, h, a)
    assert want["total"] == s * b * h * (34 + 5 * a * s / h)
    assert meter.live == want["total"] + beyond_formula(s, b, h, a, torch.bfloat16)["total"]


def test_checkpointing_keeps_only_each_layers_input():
    s, b, h, a, L = 16, 2, 32, 4, 3
    layers = [TransformerLayer(h, a).to(torch.bfloat16) for _ in range(L)]
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    with ActivationMeter() as meter:
        y = x
        for layer in layers:
            y = checkpoint(layer, y, use_reentrant=False)
    assert meter.live == L * 2 * s * b * h
    y.float().sum().backward()
    assert meter.live == 0 and x.grad is not None


def test_autocast_halves_activations_and_counts_the_weight_copies_apart():
    model = make_deep_mlp()
    x = torch.randn(16, 64)
    with ActivationMeter() as full:
        model(x)                       # the graph is freed at once; the peak stays
    with ActivationMeter() as half, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert 2 * half.peak == full.peak and full.casts == 0
    assert half.casts == 2 * sum(layer.weight.numel() for layer in model[2::2])


def test_calculator_model_states_reproduce_zero_figure_1():
    model = pp.Transformer("7.5B", 1, 1, 1, 1, 1, params=7.5e9)
    got = [round(pp.model_state_bytes(model, pp.Layout(1, 1, 64, zero=z))["total"] / 1e9, 1) for z in (0, 1, 2, 3)]
    assert got == [120.0, 31.4, 16.6, 1.9]                 # Rajbhandari et al. SC'20, figure 1


def test_calculator_activation_formulas_match_korthikanti_table_2():
    m = pp.Transformer("x", 10, 1024, 16, 512, 1000)
    s, b, h, a = 512, 2, 1024, 16
    one = pp.Layout(1, 1, 1, micro_batch=b, recompute="none", sequence_parallel=False)
    assert pp.activation_bytes_per_layer(m, one) == transformer_formula(s, b, h, a)["total"]
    sp = pp.Layout(4, 1, 1, micro_batch=b, recompute="none", sequence_parallel=True)
    assert pp.activation_bytes_per_layer(m, sp) == pytest.approx(transformer_formula(s, b, h, a)["total"] / 4)
    full = pp.Layout(4, 2, 1, micro_batch=b, recompute="full")
    assert pp.activation_bytes_per_layer(m, full) == 2 * s * b * h


def test_calculator_flops_are_narayanan_equation_3_for_gpt_with_full_recomputation():
    gpt3 = pp.Transformer("GPT-3", 96, 12288, 96, 2048, 51200)
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    eq3 = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))     # Narayanan et al. SC'21, eq. (3)
    assert pp.flops_per_step(gpt3, B, "full") == pytest.approx(eq3, rel=1e-12)
    # without recomputation the layers run forward once less; the logits (2BshV forward) never run twice
    layers_forward = 24 * B * s * L * h * h + 4 * B * s * s * h * L
    assert pp.flops_per_step(gpt3, B, "none") == pytest.approx(eq3 - layers_forward, rel=1e-12)


def test_a_llama_layer_counted_like_korthikanti_and_its_swiglu_mlp_measured():
    """Llama 3 405B's layer (table 3: SwiGLU of width 53,248, 8 key/value heads of 128, no dropout) in the paper's
    count: 8sbh kept whole under tensor parallelism, 30.25sbh split, 2as²b of scores; its SwiGLU MLP as torch keeps it
    (bf16: the input once, then gate, up, SiLU output and product, 2 bytes each) measured exactly."""
    llama = pp.Transformer("Llama 3 405B", 126, 16384, 128, 8192, 128000, 405e9, ffn=53248, kv_heads=8, gated=True,
                           dropout=False)
    assert pp.layer_activation_terms(llama) == {"replicated": 8, "split": 30.25, "scores": 2}
    gpt = pp.Transformer("GPT", 96, 12288, 96, 2048, 51200)
    assert pp.layer_activation_terms(gpt) == {"replicated": 10, "split": 24, "scores": 5}
    s, b, h, f = 16, 2, 32, 88
    torch.manual_seed(0)
    gate, up, down = (torch.nn.Linear(*d, bias=False).to(torch.bfloat16) for d in ((h, f), (h, f), (f, h)))
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    with ActivationMeter() as meter:
        out = down(torch.nn.functional.silu(gate(x)) * up(x))      # noqa: F841 (keeps the graph)
    assert meter.live == s * b * (2 * h + 4 * 2 * f)
    lay = pp.Layout(8, 16, 64, 1, 2048, zero=3, recompute="selective")
    assert pp.activation_bytes_per_layer(llama, lay) == pytest.approx(8192 * 16384 * 38.25 / 8)


def test_the_first_stage_holds_min_p_m_microbatches_of_its_layers():
    m = pp.Transformer("x", 24, 1024, 16, 512, 1000)
    one = pp.activation_bytes_per_layer(m, pp.Layout(1, 4, 1, 1, 8))
    assert pp.activation_bytes(m, pp.Layout(1, 4, 1, 1, 8)) == pytest.approx(4 * 6 * one)       # p = 4 in flight
    assert pp.activation_bytes(m, pp.Layout(1, 4, 1, 1, 2)) == pytest.approx(2 * 6 * one)       # m = 2 < p
    assert pp.activation_bytes(m, pp.Layout(1, 4, 1, 1, 8, first_stage_layers=5)) == pytest.approx(4 * 5 * one)


def test_calculator_on_bloom():
    runs = {r["name"]: r for r in hardware.training_runs()}
    r = runs["BLOOM-176B"]
    row = next(x for x in hardware.load_table("parallel_layouts") if x["model"] == "BLOOM-176B")
    bloom = pp.Transformer("BLOOM-176B", r["layers"], r["hidden"], r["heads"], row["seq_len"], 250880, r["params"])
    cl = pp.Cluster(hardware.row("accelerators", "A100 80GB SXM"), hardware.row("links", "NVLink 3 (A100)"),
                    hardware.row("links", "Omni-Path 100"), gpus_per_inter_link=2)   # 4 links for 8 GPUs per node
    lay = pp.Layout(row["tp"], row["pp"], row["dp"], row["micro_batch"], row["global_batch"], row["zero_stage"],
                    "full", False)
    assert lay.gpus == r["gpus"] and pp.estimate(bloom, lay, cl)["fits"]
    assert not pp.estimate(bloom, pp.Layout(1, 1, 384, 2, 2048, 1, "full", False), cl)["fits"]
    days = pp.flops_per_step(bloom, 1, "full") * r["tokens"] / row["seq_len"] / (384 * r["tflops_per_gpu"] * 1e12)
    # The FLOP estimate at the published rate leaves out restarts and slower stretches: below the ~117 days the
    # run took (model card dates; 1,082,990 GPU-hours / 384 / 24), about 10% short, never above it.
    assert 0.85 < days / 86400 / r["duration_days"] < 1.0
    t = pp.step_time(bloom, lay, cl)
    assert t["bubble"] == pytest.approx((lay.pp - 1) / lay.microbatches * (t["compute"] + t["tp_comm"] + t["pp_comm"]))
    found = pp.layouts(bloom, 384, cl, lay)
    assert any((x["layout"].tp, x["layout"].pp, x["layout"].dp) == (4, 12, 8) for x in found)
    assert all(x["layout"].gpus == 384 for x in found) and found[0]["fits"]


def test_plan_fits_against_the_cards_real_capacity_not_memory_gb_times_1e9():
    from course_lib.costs import hardware

    gpu = hardware.row("accelerators", "H100 SXM 80GB")
    cl = pp.Cluster(gpu, hardware.row("links", "NVLink 4 (H100)"), hardware.row("links", "Ethernet 400 GbE"))
    llama = pp.Transformer("Llama 3 405B", 126, 16384, 128, 8192, 128000, 405e9, ffn=53248, kv_heads=8, gated=True,
                           dropout=False)
    r = pp.estimate(llama, pp.Layout(8, 16, 64, 1, 2048, zero=3, recompute="selective"), cl)
    assert gpu["memory_GB"] * 1e9 < r["memory"] <= hardware.memory_bytes(gpu)     # 82.9 GB: over 80e9, under 80 GiB
    assert r["fits"]


def test_kept_bytes_counts_what_selective_checkpointing_keeps_and_nothing_freed():
    """KeptBytes sees tensors the checkpoint stores itself; a freed temporary and excluded tensors do not count."""
    import functools

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from course_lib.measure.activations import KeptBytes

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def block(t):
        return torch.relu(t @ w).sin()

    def keep_mm(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    with KeptBytes() as kept:
        y = checkpoint(block, x, use_reentrant=False,
                       context_fn=functools.partial(create_selective_checkpoint_contexts, keep_mm))
        tmp = torch.ones(100)
        del tmp
    assert kept.bytes(exclude=[y, w]) == 4 * 8 * 4          # the 4x8 product only: relu and sin are recomputed
    y.sum().backward()
    assert w.grad is not None and kept.bytes(exclude=[y, w, w.grad]) == 0    # released by backward


def test_recompute_measures_full_recomputation_by_its_bytes_and_flops():
    """measure.recompute: full recomputation keeps each layer's input and runs forward once more; a step's bytes
    peak where backward starts without it, inside backward with it."""
    from torch import nn

    from course_lib.measure.recompute import kept_bytes, step_memory

    torch.manual_seed(0)
    s, b, h, layers = 16, 2, 32, nn.ModuleList(TransformerLayer(32, 4) for _ in range(2))
    assert kept_bytes(layers, "full", s, b) == 2 * s * b * h * 4
    assert kept_bytes(layers, "none", s, b) > 10 * kept_bytes(layers, "full", s, b)
    (none, end_none), (fwd, step) = step_memory(layers, "none", s, b)
    (full, end_full), (_, step_full) = step_memory(layers, "full", s, b)
    assert step == 3 * fwd and step_full == step + fwd
    assert none.index(max(none)) >= end_none - 1 and full.index(max(full)) > end_full
