"""Checkers for notebook 14's exercises: the bubble formula and 1F1B under a memory cap (14b.1: loss_scaling.py).

14.1 and 14.2 replay schedules on the ideal clock of course_lib.training.pipeline.simulate (forward 1 slot,
backward 2, messages free); 14.2 then runs the learner's orders on real ranks with send/recv. While the learner's
code runs, the library's schedules that hold an answer are switched off (switch_off.py).
"""

from __future__ import annotations

import numbers
from contextlib import contextmanager
from fractions import Fraction

import torch.distributed as dist

from ..runtime.launch import run
from ..runtime.results import RankFailed
from ..training import pipeline as pl
from ..training.data import load_digits
from .core import ExerciseFailed, call_learner, not_attempted, passed
from .switch_off import SwitchedOff

PIPE = "course_lib.training.pipeline"
INTERLEAVED = "course_lib.training.interleaved"   # a second ideal clock (section 7): the formula by another road


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
    p = 1..12 and targets from 0.9 down to 0.01, against the schedule replayed on the ideal clock. The library's
    formula and its clock (bubble_formula, simulated_bubble, simulate) are off while the learner's code runs."""
    hint = ("How does the bubble (p-1)/(m+p-1) change as m grows? Check the bubble of your answer and of one "
            "micro-batch less.")
    cases = [(p, t) for p in range(1, 13) for t in (0.9, 0.5, 0.33, 0.25, 0.2, 0.1, 0.07, 0.05, 0.01)]
    # simulate too: building the schedules and timing them on the library's clock is the formula by another road
    with _refusals_fail(exercise, hint), _switched_off(exercise, "the bubble formula",
                                                      library=[f"{PIPE}.bubble_formula", f"{PIPE}.simulated_bubble",
                                                               f"{PIPE}.simulate", f"{INTERLEAVED}.replay",
                                                               f"{INTERLEAVED}.bubble"]):
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
        if not isinstance(got, numbers.Integral) or isinstance(got, bool):     # numpy's integers are Integral too
            raise ExerciseFailed(f"{exercise}: p={p}, target {t}: you returned {got!r}; a number of micro-batches is "
                                 f"an integer (math.ceil, or a loop).\nHint: {hint}")
        got = int(got)
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


def _warm_1f1b(stage: int, p: int, m: int, warm: int) -> list[tuple[str, int]]:
    """1F1B's order with `warm` warm-up forwards (min(p - stage - 1, m) is plain 1F1B)."""
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


def _known_mistake(order, s: int, p: int, m: int, cap: int) -> str:
    """Names the two usual ways over the cap; where they give the same order, the cut-to-cap one is named, since
    a learner who applied the cap must not be told they ignored it."""
    if order == _warm_1f1b(s, p, m, min(p - s - 1, cap, m)):
        return (" That is 1F1B with its warm-up cut to cap forwards" + (", here the same as plain 1F1B's"
                if order == _warm_1f1b(s, p, m, min(p - s - 1, m)) else "") + ": one over the cap, since the first "
                "steady-state forward adds one more before the first backward, so the warm-up may hold only cap - 1.")
    if order == _warm_1f1b(s, p, m, min(p - s - 1, m)):
        return " That is plain 1F1B, which holds min(p - stage, m)."
    return ""


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
                + _known_mistake(order, s, p, m, cap) + f"\nHint: {hint}")
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
                                                               f"{__name__}._capped_reference",
                                                               f"{__name__}._warm_1f1b"]):
        cases = [(p, m, cap) for p in range(2, 6) for m in range(1, 10) for cap in range(1, p + 1)]
        # one call_learner for the 486 orders: each call switches the launchers off and on again (~3 ms)
        answers = call_learner(exercise, lambda: {c: [[tuple(a) for a in capped_order(s, *c)] for s in range(c[0])]
                                                  for c in cases}, hint=hint)
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
