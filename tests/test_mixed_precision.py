"""Mixed precision (notebook 14): 2 + 2 + 12 = 16 bytes per parameter measured, loss scaling keeps fp16 gradients,
the course's LossScaler follows torch.amp.GradScaler step by step (the checker of exercise 14b.1 relies on it)."""

import torch
from torch import nn

from course_lib.training import combined_batch, load_digits
from course_lib.training import mixed_precision as mp
from course_lib.training.pipeline import make_deep_mlp


def test_master_weights_hold_2_2_12_bytes_per_parameter_and_train():
    model = make_deep_mlp()
    n = sum(q.numel() for q in model.parameters())
    mw = mp.MasterWeights(model, torch.float16, lr=1e-3)
    x, y = combined_batch(*load_digits(), 1, 32, 0)
    first = mw.backward(x, y, scale=2.0 ** 10)
    assert not mw.found_inf()
    mw.step(scale=2.0 ** 10)
    assert mw.held() == {"weights": 2 * n, "grads": 2 * n, "optimizer": 12 * n, "total": 16 * n}
    assert all(q.dtype == torch.float16 for q in mw.model.parameters()) and all(w.dtype == torch.float32
                                                                               for w in mw.master)
    # the 16-bit copy is the master weights rounded to fp16, exactly
    for q, w in zip(mw.model.parameters(), mw.master):
        assert torch.equal(q.detach(), w.to(torch.float16))
    for _ in range(20):
        last = mw.backward(x, y, 2.0 ** 10)
        mw.step(2.0 ** 10)
    assert last < first


def test_loss_scaling_keeps_the_fp16_gradients_that_would_flush_to_zero():
    model = make_deep_mlp()
    x, y = combined_batch(*load_digits(), 1, 32, 0)
    ref = mp.gradients(model, x, y)
    lost_plain, nonzero = mp.lost_entries(mp.gradients(model, x, y, torch.float16, 1.0), ref)
    lost_scaled, _ = mp.lost_entries(mp.gradients(model, x, y, torch.float16, 2.0 ** 16), ref)
    assert lost_plain > 100 * max(lost_scaled, 1) and nonzero > 0
    overflow = mp.gradients(model, x, y, torch.float16, 2.0 ** 40)
    assert not all(torch.isfinite(g).all() for g in overflow)


def test_loss_scaler_follows_grad_scaler():
    """Drive torch's GradScaler (cpu) with gradients that overflow at chosen steps; LossScaler must agree on every
    skip and every scale."""
    layer = nn.Linear(3, 3)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)
    ours = mp.LossScaler(2.0 ** 8, growth_interval=3)
    overflow = {1, 2, 6, 11}
    for step in range(14):
        opt.zero_grad()
        gs.scale((layer.weight * 0).sum() + (layer.bias * 0).sum()).backward()
        if step in overflow:
            layer.weight.grad[0, 0] = float("inf")
        gs.step(opt)
        gs.update()
        ours.update(step in overflow)
        assert gs.get_scale() == ours.scale, step
        assert gs._get_growth_tracker() == ours.good_steps, step


def test_number_formats():
    f16, b16 = mp.number_format(torch.float16), mp.number_format(torch.bfloat16)
    assert (f16["max"], f16["min_normal"], f16["min_subnormal"]) == (65504.0, 2.0 ** -14, 2.0 ** -24)
    assert b16["min_normal"] == torch.finfo(torch.float32).tiny and b16["unit_roundoff"] == 2.0 ** -8
