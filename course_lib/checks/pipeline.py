"""Checkers for the exercises of notebooks 14 and 14b: the bubble formula, 1F1B under a cap, loss scaling across stages.

14.1 and 14.2 replay schedules on the ideal clock of course_lib.training.pipeline.simulate (forward 1 slot,
backward 2, messages free) and, for 14.2 (1F1B under a memory cap), run the learner's orders on real ranks with
send/recv; 14b.1 runs the
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
def _capped_reference(stage: int, p: int, m: int, cap: int) -> list[tuple[str, int]]:
    """1F1B with its warm-up cut to the cap: the step every answer must match or beat on the ideal clock."""
    warm = min(p - stage - 1, cap - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


def _span(orders) -> int:
    return max(e for r in pl.simulate(orders) for *_, e in r)


def _check_order(exercise, answers, p, m, cap, hint):
    """The learner's orders for one case (asked for while the library's schedules were off), checked."""
    orders = []
    for s, order in enumerate(answers):
        want = sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        if sorted(order) != want:
            raise ExerciseFailed(f"{exercise}: p={p}, m={m}, cap={cap}, stage {s}: your order {order} must hold "
                                 f"('F', i) and ('B', i) once each for i = 0..{m - 1}.\nHint: {hint}")
        if any(order.index(("B", i)) < order.index(("F", i)) for i in range(m)):
            raise ExerciseFailed(f"{exercise}: p={p}, m={m}, cap={cap}, stage {s}: a backward comes before its own "
                                 f"forward in {order}.\nHint: {hint}")
        peak = pl.peak_in_flight(order)
        if peak > cap:
            raise ExerciseFailed(
                f"{exercise}: p={p}, m={m}, cap={cap}, stage {s} keeps {peak} micro-batches in flight (their "
                f"activations wait for backward), more than the cap. Your order: {order}."
                + (" That is plain 1F1B, which holds min(p - stage, m)." if order == pl.one_f_one_b_order(s, p, m)
                   else "") + f"\nHint: {hint}")
        orders.append(order)
    try:
        span = _span(orders)
    except RuntimeError as e:
        raise ExerciseFailed(f"{exercise}: p={p}, m={m}, cap={cap}: {e}; real ranks would hang in recv. Your "
                             f"orders: {orders}.\nHint: {hint}") from None
    best = _span([_capped_reference(s, p, m, cap) for s in range(p)])
    if span > best:
        raise ExerciseFailed(
            f"{exercise}: p={p}, m={m}, cap={cap}: your step takes {span} slots on the ideal clock (forward 1, "
            f"backward 2); orders within the same cap can do it in {best}: a stage waits that need not. Your "
            f"orders: {orders}.\nHint: {hint}")
    return orders


def _run_orders(orders, m, data):
    rank = dist.get_rank()
    r = pl.train_stage(lambda st, xs, ys, mm: pl.run_order(st, orders[rank], xs, ys, mm), steps=1, m=m, data=data)
    return r["params"], r["peak_bytes"], r["microbatch_bytes"]


def check_capped_order(capped_order, exercise: str = "Exercise 14.2 (1F1B under a memory cap)") -> None:
    """`capped_order(stage, p, m, cap)` -> that stage's list of ("F", i) / ("B", i), at most `cap` micro-batches in
    flight: replayed on an ideal clock for p = 2..5, m = 1..9, cap = 1..p (no deadlock, within the cap, a step no
    longer than 1F1B with its warm-up cut to the cap), then run with send/recv on 4 real ranks with cap 2: weights =
    single-process SGD, peak activation bytes = the order's micro-batches in flight."""
    hint = ("Count the micro-batches stage s holds just before its first backward, in 1F1B and under the cap; then "
            "check that every stage still receives the inputs it waits for.")
    with _refusals_fail(exercise, hint), _switched_off(exercise, "scheduling under a memory cap",
                                                      library=[f"{PIPE}.one_f_one_b_order", f"{PIPE}.gpipe_order",
                                                               f"{__name__}._capped_reference"]):
        cases = [(p, m, cap) for p in range(2, 6) for m in range(1, 10) for cap in range(1, p + 1)]
        answers = {c: [[tuple(a) for a in call_learner(exercise, capped_order, s, *c, hint=hint)]
                       for s in range(c[0])] for c in cases}
    for case in cases:
        _check_order(exercise, answers[case], *case, hint)
    real = answers[(4, 8, 2)]
    reference, _ = pl.train_reference(steps=1)
    try:
        vals = run(_run_orders, world_size=4, args=(real, 8, load_digits()), output="none", timeout=60,
                   nccl_rules=True).values
    except RankFailed as e:
        raise ExerciseFailed(f"{exercise}: your orders failed on 4 real ranks (rank {e.rank}):\n{e}\n"
                             f"Hint: {hint}") from None
    from ..training.tolerance import max_diff, sgd_atol
    for s, ((params, peak, per_mb), want) in enumerate(zip(vals, pl.stage_params(reference, 4))):
        if max_diff(params, want) > sgd_atol(1, 0.1, 32, 256):
            raise ExerciseFailed(f"{exercise}: 4 ranks: stage {s}'s weights after one step differ from "
                                 f"single-process SGD by {max_diff(params, want):.2e}.\nHint: {hint}")
        if peak != pl.peak_in_flight(real[s]) * per_mb:
            raise ExerciseFailed(f"{exercise}: 4 ranks: stage {s} kept {peak} bytes of activations at its peak, "
                                 f"{peak / per_mb:g} micro-batches' worth; your order has "
                                 f"{pl.peak_in_flight(real[s])} in flight.")
    passed(exercise, "no deadlock, within the cap and no slower than 1F1B cut to the cap for p = 2..5, m = 1..9, "
                     "cap = 1..p; on 4 real ranks with cap 2 the weights equal single-process SGD and the activations "
                     "kept match your order")


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
