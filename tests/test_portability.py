"""The equivalence checks hold on any machine, shown on this one: the single-process references recomputed with their
sums in other orders (reversed batch, per-worker pieces, 1 or 2 threads, deterministic algorithms, float64 rounded
to float32) stay far inside the tolerances of training/tolerance.py, the parallel runs match every one of them, the
assumptions the tolerances rest on hold for the course models, and each tolerance still catches a real mistake."""

import itertools

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from course_lib import run
from course_lib.labs import elastic
from course_lib.training import tolerance
from course_lib.training.adam import adam_step
from course_lib.training.allreduce import dp_train
from course_lib.training.data import combined_batch, load_digits
from course_lib.training.model import flat_params, make_mlp
from course_lib.training.tolerance import GRAD, WEIGHT, adam_atol, max_diff, sgd_atol
from course_lib.training.zero import zero_train

N, STEPS, BATCH, HIDDEN, LR, ADAM_LR = 2, 4, 16, 256, 0.1, 1e-3
ORDERS = ("plain", "reversed", "pieces", "pieces_reversed", "one_thread", "deterministic", "from_float64")


def train(order="plain", optimizer="sgd", dtype=torch.float32, steps=STEPS, grad_scale=1.0, t_shift=0, n=N):
    """Single-process training on the combined batch with its sums done another way (`order`); `grad_scale` and
    `t_shift` make the two mistakes the tolerances must catch (a sum for a mean, Adam's bias correction one off)."""
    if order == "from_float64":
        return train("plain", optimizer, torch.float64, steps, grad_scale, t_shift, n).float()
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if order == "one_thread" else threads)
    torch.use_deterministic_algorithms(order == "deterministic")
    try:
        x, y = load_digits()
        model = make_mlp(HIDDEN, 0, dtype)
        params = list(model.parameters())
        m, v = [torch.zeros_like(q) for q in params], [torch.zeros_like(q) for q in params]
        for step in range(steps):
            xb, yb = combined_batch(x.to(dtype), y, n, BATCH, step)
            if order == "reversed":
                xb, yb = xb.flip(0), yb.flip(0)
            model.zero_grad()
            pieces = list(zip(xb.chunk(n), yb.chunk(n))) if order.startswith("pieces") else [(xb, yb)]
            for xp, yp in (reversed(pieces) if order == "pieces_reversed" else pieces):
                (nn.functional.cross_entropy(model(xp), yp) * len(xp) / len(xb)).backward()
            with torch.no_grad():
                for q, mq, vq in zip(params, m, v):
                    g = q.grad * grad_scale
                    if optimizer == "sgd":
                        q -= LR * g
                    else:
                        adam_step(q, g, mq, vq, step + 1 + t_shift, ADAM_LR)
        return flat_params(model)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)


def spread(results) -> float:
    return max(max_diff(a, b) for a, b in itertools.combinations(results, 2))


SGD_TOL = sgd_atol(STEPS, LR, N * BATCH, HIDDEN)
ADAM_TOL = adam_atol(STEPS, ADAM_LR, N * BATCH, HIDDEN)


@pytest.fixture(scope="module")
def sgd_refs():
    return {o: train(o) for o in ORDERS}


@pytest.fixture(scope="module")
def adam64_refs():
    return {o: train(o, "adam", torch.float64) for o in ORDERS if o != "from_float64"}


def test_sgd_references_in_other_orders_stay_far_inside_the_tolerance(sgd_refs):
    measured = spread(sgd_refs.values())
    assert measured <= SGD_TOL / 100, (measured, SGD_TOL)      # measured here: about 1e-8 against 4e-5


def test_data_parallel_matches_every_reordered_reference(sgd_refs):
    def dp(threads):
        torch.set_num_threads(threads)        # another blocking of the same matrix products inside the ranks
        return dp_train(steps=STEPS, batch_size=BATCH, method="bucket", bucket_bytes=50_000)["params"]

    for threads in (1, 2):
        for r, got in enumerate(run(dp, world_size=N, args=(threads,), output="none", timeout=60).values):
            for order, ref in sgd_refs.items():
                assert max_diff(got, ref) <= SGD_TOL, (threads, r, order)


def test_adam_in_float64_holds_in_any_order_and_float32_cannot(adam64_refs):
    measured = spread(adam64_refs.values())
    assert measured <= ADAM_TOL / 1000, (measured, ADAM_TOL)    # measured here: about 1e-16 against 1.2e-7
    # float32: the bound is as large as Adam's whole movement (each step moves a weight by at most about lr)
    assert adam_atol(STEPS, ADAM_LR, N * BATCH, HIDDEN, torch.float32) >= 1.9 * ADAM_LR * STEPS


def test_zero_in_float64_matches_every_reordered_reference(adam64_refs):
    res = run(zero_train, world_size=N, args=(1,), kwargs=dict(steps=STEPS, batch_size=BATCH, hidden=HIDDEN,
                                                              dtype=torch.float64, comm_log=False),
              output="none", timeout=60)
    for r, v in enumerate(res.values):
        for order, ref in adam64_refs.items():
            assert max_diff(v["params"], ref) <= ADAM_TOL, (r, order)


def test_each_tolerance_still_catches_a_real_mistake(sgd_refs, adam64_refs):
    sgd_ref, adam_ref = sgd_refs["plain"], adam64_refs["plain"]
    assert max_diff(train(grad_scale=N), sgd_ref) > 10 * SGD_TOL                       # gradients summed, not averaged
    assert max_diff(train(steps=STEPS - 1), train(steps=STEPS)) > 10 * SGD_TOL          # a step lost
    assert max_diff(train(optimizer="adam", dtype=torch.float64, grad_scale=N), adam_ref) > 10 * ADAM_TOL
    assert max_diff(train(optimizer="adam", dtype=torch.float64, t_shift=1), adam_ref) > 10 * ADAM_TOL


def _per_sample_grad_max(model, loss_fn, x, y) -> float:
    params = {k: q.detach() for k, q in model.named_parameters()}

    def loss(p, xi, yi):
        return loss_fn(functional_call(model, p, (xi[None],)), yi[None])

    return max(g.abs().max().item() for g in vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y).values())


def test_the_course_models_satisfy_the_tolerances_assumptions():
    # digits MLP, the trainers' first 30 SGD steps at lr 0.1 (the longest run compared: tensor parallel's) on 2 x 32
    x, y = load_digits()
    model = make_mlp(HIDDEN, 0)
    for step in range(30):
        xb, yb = combined_batch(x, y, 2, 32, step)
        assert _per_sample_grad_max(model, nn.functional.cross_entropy, xb, yb) <= GRAD, step
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        with torch.no_grad():
            for q in model.parameters():
                q -= 0.1 * q.grad
        assert max(q.abs().max().item() for q in model.parameters()) <= WEIGHT, step
    # the elastic lab's model: MSE on targets up to about 10, its own bound
    model, opt = elastic.make_model()
    for step in range(12):
        for rank in range(2):
            xb, yb = elastic.batch(step, rank)
            assert _per_sample_grad_max(model, nn.functional.mse_loss, xb, yb) <= elastic.GRAD, step
            nn.functional.mse_loss(model(xb), yb).backward()
        for q in model.parameters():
            q.grad /= 2
        opt.step()
        opt.zero_grad()


def test_unit_roundoff_and_adam_ratio_bound():
    assert tolerance.unit_roundoff(torch.float32) == 2.0 ** -24 and tolerance.unit_roundoff(torch.float64) == 2.0 ** -53
    assert tolerance.adam_ratio_bound(1) == pytest.approx(1.0)
    # Cauchy-Schwarz is tight: gradients g_i = a_i / c_i make Adam's own m̂/√v̂ equal the bound after t steps
    t, (b1, b2) = 5, tolerance.BETAS
    a = [(1 - b1) * b1 ** (t - i) / (1 - b1 ** t) for i in range(1, t + 1)]
    c = [(1 - b2) * b2 ** (t - i) / (1 - b2 ** t) for i in range(1, t + 1)]
    m = v = 0.0
    for ai, ci in zip(a, c):
        g = ai / ci
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    ratio = (m / (1 - b1 ** t)) / (v / (1 - b2 ** t)) ** 0.5
    assert ratio == pytest.approx(tolerance.adam_ratio_bound(t), rel=1e-12)
