"""Checkers for the exercises of notebooks 14 and 14b: the bubble formula, the 1F1B order, loss scaling across stages.

14.1 and 14.2 replay schedules on the ideal clock of course_lib.training.pipeline.simulate (forward 1 slot,
backward 2, messages free) and, for 14.2, run the learner's order on real ranks with send/recv; 14b.1 runs the
learner's loss-scaled step on real ranks, one stage each, an inf or a NaN injected on one stage only, against
GradScaler's rules (training.mixed_precision.LossScaler), counting the collectives with CommLog. While the learner's
code runs, the library functions that hold an answer, torch's GradScaler and its two kernels
(torch._amp_foreach_non_finite_check_and_unscale_, torch._amp_update_scale_) are switched off (switch_off.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.launch import run
from ..runtime.results import RankFailed
from ..training import pipeline as pl
from ..training.data import load_digits
from ..training.mixed_precision import LossScaler
from .core import ExerciseFailed, call_learner, not_attempted, passed
from .switch_off import SwitchedOff

PIPE = "course_lib.training.pipeline"


def _switched_off(exercise: str, why: str, library=(), forbid=()):
    from .switch_off import switched_off
    return switched_off(exercise, forbid=forbid, why=why, library=library)


@contextmanager
def _refusals_fail(exercise: str, hint: str):
    """A switched-off function reached (or reached, caught and carried on from) becomes the exercise's failure."""
    try:
        yield
    except SwitchedOff as e:
        raise ExerciseFailed(f"{e}\nHint: {hint}") from None


# ---------------------------------------------------------------------------------------------- 14.1
def _smallest_m(p: int, target: float) -> int:
    m = 1
    while pl.bubble_formula(p, m) > target:
        m += 1
    return m


def _float_tie(p: int, m: int, target: float) -> bool:
    """True where the exact bubble of m equals the decimal target that the float `target` only approximates
    (0.2, 0.1, ...): there a closed form such as ceil((p-1)(1-t)/t) computed in floats may round up by one (at p=4,
    t=0.2 it gives 13 for 12), and m+1 is accepted too. At targets that floats hold exactly (0.5, 0.25) no rounding
    happens, so "bubble < target" instead of "<= target" is still refused there."""
    exact = Fraction(repr(target))
    return Fraction(target) != exact and pl.bubble_formula(p, m) == exact


def check_min_microbatches(min_microbatches, exercise: str = "Exercise 14.1 (micro-batches for a bubble)") -> None:
    """`min_microbatches(p, target)` -> the smallest m whose bubble (p-1)/(m+p-1) is at most `target`; checked on
    p = 1..12 and targets from 0.9 down to 0.01, against the schedule replayed on the ideal clock."""
    hint = ("How does the bubble (p-1)/(m+p-1) change as m grows? Check the bubble of your answer and of one "
            "micro-batch less.")
    cases = [(p, t) for p in range(1, 13) for t in (0.9, 0.5, 0.33, 0.25, 0.2, 0.1, 0.07, 0.05, 0.01)]
    with _refusals_fail(exercise, hint), _switched_off(exercise, "the bubble formula",
                                                      library=[f"{PIPE}.bubble_formula", f"{PIPE}.simulated_bubble"]):
        try:
            answers = [min_microbatches(p, t) for p, t in cases]
        except NotImplementedError as e:
            raise not_attempted(exercise, str(e)) from None
        except SwitchedOff as e:
            raise ExerciseFailed(f"{e}\nHint: {hint}") from None
        except Exception as e:
            raise ExerciseFailed(f"{exercise}: your function raised {type(e).__name__}: {e}\nHint: {hint}") from None
    for (p, t), got in zip(cases, answers):
        want = _smallest_m(p, t)
        if not isinstance(got, int) or isinstance(got, bool):
            raise ExerciseFailed(f"{exercise}: p={p}, target {t}: you returned {got!r}; a number of micro-batches is "
                                 f"an int (math.ceil, or a loop).\nHint: {hint}")
        if got != want and not (got == want + 1 and _float_tie(p, want, t)):
            shown = "; ".join(f"m={k}: {float(pl.bubble_formula(p, k)):.4f}" for k in sorted({got - 1, got, want})
                              if k >= 1)
            replay = pl.simulated_bubble([pl.one_f_one_b_order(s, p, want) for s in range(p)])[0]
            raise ExerciseFailed(
                f"{exercise}: p={p} stages, target bubble {t}: you returned m={got}, expected {want}.\n"
                f"  bubble (p-1)/(m+p-1) at {shown} (the schedule with m={want}, replayed on an ideal clock, idles "
                f"{float(replay):.4f}).\nHint: {hint}")
    passed(exercise, f"the smallest m for {len(cases)} (p, target) pairs, p = 1..12, targets 0.9 down to 0.01")


# ---------------------------------------------------------------------------------------------- 14.2
def _check_order(exercise, order_fn, p, m, hint):
    orders = []
    for s in range(p):
        order = [tuple(a) for a in call_learner(exercise, order_fn, s, p, m, hint=hint)]
        want = sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        if sorted(order) != want:
            raise ExerciseFailed(f"{exercise}: p={p}, m={m}, stage {s}: your order {order} must hold ('F', i) and "
                                 f"('B', i) once each for i = 0..{m - 1}.\nHint: {hint}")
        if any(order.index(("B", i)) < order.index(("F", i)) for i in range(m)):
            raise ExerciseFailed(f"{exercise}: p={p}, m={m}, stage {s}: a backward comes before its own forward in "
                                 f"{order}.\nHint: {hint}")
        orders.append(order)
    try:
        bubble = pl.simulated_bubble(orders)
    except RuntimeError as e:
        raise ExerciseFailed(f"{exercise}: p={p}, m={m}: {e}; real ranks would hang in recv.\nHint: {hint}") from None
    for s, order in enumerate(orders):
        peak, want = pl.peak_in_flight(order), min(p - s, m)
        if peak > want:
            raise ExerciseFailed(
                f"{exercise}: p={p}, m={m}, stage {s} keeps {peak} micro-batches in flight (their activations wait "
                f"for backward); 1F1B keeps at most min(p - stage, m) = {want}. Your order: {order}."
                + (" All forwards before any backward is GPipe." if peak == m else "") + f"\nHint: {hint}")
        if bubble[s] != pl.bubble_formula(p, m):
            raise ExerciseFailed(
                f"{exercise}: p={p}, m={m}, stage {s} idles {float(bubble[s]):.3f} of the step on an ideal clock, "
                f"more than the {float(pl.bubble_formula(p, m)):.3f} of (p-1)/(m+p-1): too few warm-up forwards "
                f"leave later stages waiting. Your order: {order}.\nHint: {hint}")
    return orders


def _run_orders(orders, m, data):
    rank = dist.get_rank()
    r = pl.train_stage(lambda st, xs, ys, mm: pl.run_order(st, orders[rank], xs, ys, mm), steps=1, m=m, data=data)
    return r["params"], r["peak_bytes"], r["microbatch_bytes"]


def check_one_f_one_b(one_f_one_b_order, exercise: str = "Exercise 14.2 (the 1F1B order)") -> None:
    """`one_f_one_b_order(stage, p, m)` -> that stage's list of ("F", i) / ("B", i): every stage's order replayed
    on an ideal clock for p = 2..5 and m = 1..9 (no deadlock, bubble = (p-1)/(m+p-1), at most min(p - stage, m)
    micro-batches in flight), then run with send/recv on 2 and 4 real ranks: weights = single-process SGD."""
    hint = ("In 1F1B a stage does some forwards before its first backward, then alternates. How many micro-batches are "
            "in flight on stage s when the first backward reaches it?")
    with _refusals_fail(exercise, hint), _switched_off(exercise, "the 1F1B order",
                                                      library=[f"{PIPE}.one_f_one_b_order"]):
        for p in range(2, 6):
            for m in range(1, 10):
                _check_order(exercise, one_f_one_b_order, p, m, hint)
        real = {p: [[tuple(a) for a in one_f_one_b_order(s, p, 8)] for s in range(p)] for p in (2, 4)}
    reference, _ = pl.train_reference(steps=1)
    data = load_digits()
    for p, orders in real.items():
        try:
            vals = run(_run_orders, world_size=p, args=(orders, 8, data), output="none", timeout=60,
                       nccl_rules=True).values
        except RankFailed as e:
            raise ExerciseFailed(f"{exercise}: your orders failed on {p} real ranks (rank {e.rank}):\n{e}\n"
                                 f"Hint: {hint}") from None
        from ..training.tolerance import max_diff, sgd_atol
        for s, ((params, peak, per_mb), want) in enumerate(zip(vals, pl.stage_params(reference, p))):
            if max_diff(params, want) > sgd_atol(1, 0.1, 32, 256):
                raise ExerciseFailed(f"{exercise}: {p} ranks: stage {s}'s weights after one step differ from "
                                     f"single-process SGD by {max_diff(params, want):.2e}.\nHint: {hint}")
            if peak != min(p - s, 8) * per_mb:
                raise ExerciseFailed(f"{exercise}: {p} ranks: stage {s} kept {peak} bytes of activations at its "
                                     f"peak, {peak / per_mb:g} micro-batches' worth; 1F1B keeps {min(p - s, 8)}.")
    passed(exercise, "no deadlock, bubble (p-1)/(m+p-1) and at most min(p - stage, m) micro-batches in flight "
                     "for p = 2..5, m = 1..9; on 2 and 4 real ranks the weights equal single-process SGD")


# ---------------------------------------------------------------------------------------------- 14b.1
STEPS = 8
# step -> (the one stage, its bad value, the parameter it is in): a bias too, so a check of the weight alone fails
OVERFLOW = {2: (1, float("inf"), "weight"), 3: (0, float("nan"), "bias"), 5: (1, float("nan"), "weight"),
            6: (0, float("inf"), "bias")}
AMP_KERNELS = ("_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_")   # GradScaler's own, as torch ops


@contextmanager
def _no_amp_kernels(exercise: str):
    """GradScaler's two kernels refused however they are reached (torch._amp_update_scale_, torch.ops.aten....):
    a dispatch mode sees the aten operator that every road ends in."""
    from . import switch_off

    class NoAmp(switch_off._dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if func.namespace == "aten" and name in AMP_KERNELS:
                message = switch_off._say(exercise, "loss scaling by hand", f"GradScaler's kernel torch.{name}")
                switch_off._attempts.append(message)
                raise SwitchedOff(message)
            return func(*args, **(kwargs or {}))

    with NoAmp():
        yield


def _loss_scaling_case(learner, growth_interval, lr):
    from ..measure.comm_log import CommLog
    from ..runtime.devices import device
    rank = dist.get_rank()
    torch.manual_seed(rank)
    stage = nn.Linear(4, 4).to(device())
    scaler = {"scale": 2.0 ** 10, "good_steps": 0, "growth_interval": growth_interval}
    history = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        for q in stage.parameters():
            q.grad = (torch.randn(q.shape, generator=g) * scaler["scale"]).to(q.device)   # of loss x scale
        bad_rank, bad, where = OVERFLOW.get(step, (None, None, None))
        if bad_rank == rank:
            getattr(stage, where).grad.view(-1)[0] = bad
        with CommLog() as log:
            with _switched_off("Exercise 14b.1", "loss scaling by hand",
                               library=["torch.amp.grad_scaler.GradScaler.unscale_",
                                        "torch.amp.grad_scaler.GradScaler.step",
                                        "torch.amp.grad_scaler.GradScaler.update",
                                        "course_lib.training.mixed_precision.LossScaler.update"]), \
                    _no_amp_kernels("Exercise 14b.1"):
                stepped = learner(stage, lr, scaler)
        history.append((bool(stepped), scaler["scale"], scaler["good_steps"], [c.op for c in log.calls],
                        [q.detach().cpu().clone() for q in stage.parameters()]))
    return history


def _reference_history(rank, growth_interval, lr):
    torch.manual_seed(rank)
    stage = nn.Linear(4, 4)
    sc = LossScaler(2.0 ** 10, growth_interval=growth_interval)
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        grads = [torch.randn(q.shape, generator=g) * sc.scale for q in stage.parameters()]
        found = step in OVERFLOW                        # on one stage, so on every stage
        scale = sc.scale
        if sc.update(found):
            with torch.no_grad():
                for q, gr in zip(stage.parameters(), grads):
                    q -= lr * gr / scale
        out.append((not found, sc.scale, sc.good_steps, [q.detach().clone() for q in stage.parameters()]))
    return out


def check_loss_scaling(scaled_sgd_step, exercise: str = "Exercise 14b.1 (loss scaling across stages)") -> None:
    """`scaled_sgd_step(stage, lr, scaler)` on every pipeline stage: the stage's .grad hold gradients of
    loss x scaler["scale"]; unscale, skip the step on every stage if any stage's gradients hold inf/NaN (one
    collective), update scaler["scale"] and scaler["good_steps"] by GradScaler's rules; return whether it stepped."""
    hint = ("What must every stage know before any of them touches its weights, and which values count as an "
            "overflow? Reread the statement's rules for the scale, step by step, against the numbers above.")
    lr, growth = 0.1, 2
    for world in (2, 3):
        try:
            vals = run(_loss_scaling_case, world_size=world, args=(scaled_sgd_step, growth, lr), output="none",
                       timeout=60, nccl_rules=True).values
        except RankFailed as e:
            if e.failure.etype == "NotImplementedError":
                raise not_attempted(exercise, e.failure.message) from None
            if e.failure.etype == "SwitchedOff":
                raise ExerciseFailed(f"{e.failure.message}\nHint: {hint}") from None
            raise ExerciseFailed(f"{exercise}: rank {e.rank} failed with {world} stages:\n{e}\nHint: {hint}") from None
        refs = [_reference_history(rank, growth, lr) for rank in range(world)]
        for step in range(STEPS):
            per_rank = [h[step] for h in vals]
            stepped = [h[0] for h in per_rank]
            if len(set(stepped)) > 1:
                who = ", ".join(f"stage {r} {'stepped' if s else 'skipped'}" for r, s in enumerate(stepped))
                raise ExerciseFailed(
                    f"{exercise}: {world} stages, step {step}: {who}. The overflow was on one stage only; a pipeline "
                    f"step is one step of the whole model, so every stage must skip it together.\nHint: {hint}")
            for rank, got in enumerate(per_rank):
                want = refs[rank][step]
                if got[0] != want[0]:
                    bad = ("run" if want[0] else
                           "be skipped (a {2} gradient on stage {0} is {1})".format(*OVERFLOW[step]))
                    raise ExerciseFailed(f"{exercise}: {world} stages, step {step}: your step "
                                         f"{'ran' if got[0] else 'was skipped'}; it should {bad}.\nHint: {hint}")
                if (got[1], got[2]) != (want[1], want[2]):
                    raise ExerciseFailed(
                        f"{exercise}: {world} stages, step {step}, stage {rank}: after the step scale = {got[1]:g}, "
                        f"good_steps = {got[2]}; expected scale = {want[1]:g}, good_steps = {want[2]} (growth_interval "
                        f"{growth}).\nHint: {hint}")
                diff = max((a - b).abs().max().item() for a, b in zip(got[4], want[3]))
                # 1e-6: updates of about lr x 1 = 0.1 on weights below 1, in float32 (u = 6e-8): lr, grad and 1/scale
                # multiplied in another order differ by a few roundings, ~1e-8; a wrong scale or a missed skip, >= 1e-2
                if not diff <= 1e-6:                  # also a NaN that reached the weights
                    raise ExerciseFailed(
                        f"{exercise}: {world} stages, step {step}, stage {rank}: weights differ from the reference by "
                        f"{diff:.3g}; the gradients hold loss x scale: which scale, and does it change before you "
                        f"use it?\nHint: {hint}")
                if len(got[3]) != 1:  # any one collective that tells every stage: an all_reduce, an all_gather, ...
                    raise ExerciseFailed(
                        f"{exercise}: {world} stages, step {step}, stage {rank}: your step ran {got[3] or 'no '} "
                        f"collectives; how many does it take for every stage to agree on one bit?\nHint: {hint}")
    passed(exercise, f"2 and 3 stages, {STEPS} steps with an inf or a NaN on one stage: every stage skips together, "
                     f"scale and weights follow GradScaler's rules, one collective per step")
