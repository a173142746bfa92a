"""Checkers for the exercises that estimate a number from the course's tables and formulas (notebooks 07, 16;
notebook 01's are in walls.py, notebook 02's in cluster.py): the expected value is computed here from data/ and
course_lib's formulas, never written in a check cell.

A wrong answer gets what was given and a hint at the method, not the number.
"""

from __future__ import annotations

import math

from ..bench.collectives import FACTORS
from ..costs import alpha_beta
from ..costs import hardware as hw
from .core import ExerciseFailed, call_learner, passed, with_hint


def _number(exercise, got, what):
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise ExerciseFailed(f"{exercise}: return {what} as a number; you returned {got!r}.")
    return got


# ---------------------------------------------------------------- notebook 07
def check_all_gather_bandwidths(all_gather_bandwidths, exercise: str = "Exercise 7.1") -> None:
    """(algbw, busbw) in GB/s of an all_gather on 8 ranks, S = 1 GiB of output, in 10 ms (nccl-tests' definitions,
    doc/PERFORMANCE.md: algbw = S/t, busbw = algbw x (n-1)/n for all_gather)."""
    hint = ("Which size does nccl-tests divide by for algbw, in which units (GiB or GB), and how does it turn "
            "all_gather's algbw into a bus bandwidth (its doc/PERFORMANCE.md)?")
    got = call_learner(exercise, all_gather_bandwidths, hint=hint, why="nccl-tests' bus bandwidth factors",
                       library=tuple(f"course_lib.bench.collectives.FACTORS.{op}" for op in FACTORS))
    pair = _two_numbers(got)
    if pair is None:
        raise ExerciseFailed(f"{exercise}: return two numbers, (algbw, busbw); you returned {got!r}.")
    got = pair
    algbw = (1 << 30) / 10e-3 / 1e9
    # 0.5%: an answer rounded to whole GB/s (107, 94) passes; GiB for GB (7%) or another factor (12% and more) does not
    if not math.isclose(got[0], algbw, rel_tol=5e-3):
        raise ExerciseFailed(with_hint(f"{exercise}: your algbw {got[0]:.4g} GB/s is not S/t.", hint))
    if not math.isclose(got[1], algbw * 7 / 8, rel_tol=5e-3):
        raise ExerciseFailed(with_hint(f"{exercise}: your busbw {got[1]:.4g} GB/s does not use all_gather's factor "
                                       "for 8 ranks.", hint))
    return passed(exercise, f"algbw {got[0]:.1f} GB/s, busbw {got[1]:.1f} GB/s")


def _synthetic_rows() -> list[dict]:
    """A sweep this machine did not make: 3 ranks, the course ring at alpha 300 us and 0.4 GB/s with +-6% wobble,
    beside all_reduce rows with other times, so a fit must pick the right rows, units and ranks."""
    rows = []
    for i, size in enumerate(4096 << j for j in range(12)):
        wobble = 1 + 0.06 * ((-1) ** i)
        ring_s = alpha_beta.ring_allreduce(3, size, 300e-6, 1 / 0.4e9) * wobble
        rows.append({"op": "ring", "size_bytes": size, "ranks": 3, "time_us": ring_s * 1e6})
        rows.append({"op": "all_reduce", "size_bytes": size, "ranks": 3, "time_us": ring_s * 0.5e6 + 40})
    return rows


def _relative_rms(rows, alpha, beta) -> float:
    ring = [r for r in rows if r["op"] == "ring"]
    p = ring[0]["ranks"]
    errs = [(alpha_beta.ring_allreduce(p, r["size_bytes"], alpha, beta) - r["time_us"] / 1e6) / (r["time_us"] / 1e6)
            for r in ring]
    return math.sqrt(sum(e * e for e in errs) / len(errs))


# The course's own fits: each holds exercise 7.2's answer (fit_pieces and fit_line reach _relative_lsq).
_FITS = tuple(f"course_lib.costs.alpha_beta.{name}" for name in ("fit_alpha_beta", "fit_line", "fit_pieces",
                                                                  "_relative_lsq"))


def _two_numbers(got):
    """(x, y) as floats when got is a pair of numbers (Python, numpy, a tuple of one-element tensors, or a tensor or
    array of two elements such as lstsq's 2 x 1 solution), else None."""
    if hasattr(got, "tolist") and not isinstance(got, (tuple, list)):
        got = got.tolist()
        got = [g[0] if isinstance(g, list) and len(g) == 1 else g for g in got] if isinstance(got, list) else got
    if not (isinstance(got, (tuple, list)) and len(got) == 2) or any(isinstance(g, (bool, str)) for g in got):
        return None
    try:
        return tuple(float(g) for g in got)
    except (TypeError, ValueError, RuntimeError):
        return None


def check_course_ring_fit(fit_course_ring, rows, exercise: str = "Exercise 7.2") -> None:
    """(alpha, beta) of the ring model t = 2(p-1) alpha + 2(p-1)/p S beta for the course ring's rows (op 'ring'),
    fitted by the learner's own weighted least squares (the course's fits are switched off while it runs). Any fit
    is accepted whose relative errors (model - t)/t have a root mean square within 0.02 of the best possible (the
    relative least-squares fit, alpha_beta.fit_alpha_beta); checked on the measured sweep and on a sweep of another
    machine with 3 ranks, so a fit of the wrong rows, units, ranks or weights, or fixed numbers, fail."""
    hint = ("Which rows are the course's ring, in which units are their sizes and times, and what does the ring's "
            "model say one call of S bytes costs on p ranks? Sizes span four orders of magnitude: a least squares on "
            "the times themselves lets the largest sizes decide; which errors does the exercise ask you to minimise?")
    for name, case in (("the measured sweep", rows), ("another machine's sweep (3 ranks)", _synthetic_rows())):
        got = call_learner(exercise, fit_course_ring, case, hint=hint, library=_FITS,
                           why="fitting alpha and beta by least squares")
        pair = _two_numbers(got)
        if pair is None or not all(math.isfinite(g) and g >= 0 for g in pair):
            raise ExerciseFailed(with_hint(f"{exercise}: on {name} you returned {got!r}, not (alpha, beta): two "
                                           "numbers, seconds and seconds per byte.", hint))
        got = pair
        ring = [r for r in case if r["op"] == "ring"]
        best = alpha_beta.fit_alpha_beta([r["size_bytes"] for r in ring], [r["time_us"] / 1e6 for r in ring],
                                        p=ring[0]["ranks"], algorithm="ring")
        mine, least = _relative_rms(case, *got), _relative_rms(case, *best)
        if mine > least + 0.02 and got[0] < 1e-3 * best[0]:
            raise ExerciseFailed(with_hint(
                f"{exercise}: on {name} your alpha = {got[0]:.3g} s is about zero: was the least squares solved in "
                "float32, or with S in bytes beside a column of ones? A solver that drops small singular values then "
                "drops alpha's column; use float64, or scale S (to MiB, say) and scale beta back.", hint))
        if mine > least + 0.02:
            raise ExerciseFailed(with_hint(
                f"{exercise}: on {name} your alpha = {got[0]:.3g} s, beta = {got[1]:.3g} s/byte miss the ring rows by "
                f"{100 * mine:.0f}% (root mean square of the relative errors); the best fit misses by "
                f"{100 * least:.0f}%.", hint))
    return passed(exercise, "your fit predicts the ring rows as well as the best one, on both sweeps")


# ---------------------------------------------------------------- notebook 16
def _per_gpu_day() -> float:
    llama = next(r for r in hw.load_table("failure_rates") if r["run"].startswith("Llama 3"))
    return llama["interruptions_unexpected"] / llama["days"] / llama["accelerators"]


def _max_save_s(gpus: int, restart_s: float, waste: float) -> float:
    """The longest save C with C/T + T/(2M) + R/M <= waste at Young's T = sqrt(2CM) (CACM 17(9), 1974): there the
    two terms are equal, sqrt(C/(2M)) each, so sqrt(2C/M) <= waste - R/M; 0 when R/M alone exceeds the budget."""
    mtbf_s = 86400 / (gpus * _per_gpu_day())
    left = waste - restart_s / mtbf_s
    return mtbf_s * left * left / 2 if left > 0 else 0.0


# The learner's function may not call the checker's own answer (one import away).
_MAX_SAVE_ANSWER = ("course_lib.checks.estimates._max_save_s",)


def check_max_save_s(max_save_s, exercise: str = "Exercise 16.2") -> None:
    """The longest checkpoint save, in seconds, that keeps what a job on n GPUs loses (saves, work redone, restarts)
    within a budget when it checkpoints at Young's interval, at Llama 3's rate per GPU (data/failure_rates.csv)."""
    hint = ("What is the mean time M between interruptions of that many GPUs, in seconds? What do the two terms "
            "C/T + T/(2M) add up to at Young's T = sqrt(2CM), and what is left of the budget once every "
            "interruption has paid its restart?")
    for gpus, restart_s, waste in ((16384, 600, 0.1), (1024, 300, 0.05), (100_000, 60, 0.1), (8, 3600, 0.01),
                                   (100_000, 600, 0.1)):
        got = _number(exercise, call_learner(exercise, max_save_s, gpus, restart_s, waste, hint=hint,
                                             library=_MAX_SAVE_ANSWER, why="solving Young's waste for C"),
                      "seconds")
        want = _max_save_s(gpus, restart_s, waste)
        # 1e-4: the closed form, a bisection or a search to four digits pass; Daly's interval sqrt(2C(M+R)) in place
        # of Young's is 7e-4 off at 16,384 GPUs, and a wrong model is off by 10% and more
        if not math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-9):
            why = " (can a save take less than no time?)" if got < 0 else ""
            close = (" That is close, within 1%: how precise is your search or rounding, and is T Young's sqrt(2CM)?"
                     if want and math.isclose(got, want, rel_tol=0.01) else "")
            raise ExerciseFailed(with_hint(f"{exercise}: {gpus} GPUs, {restart_s} s per restart, at most "
                                           f"{waste:.0%} lost: you said {got:.6g} s{why}.{close}", hint))
    return passed(exercise, f"a 16,384-GPU job with 10-minute restarts keeps 90% if a save takes at most "
                            f"{max_save_s(16384, 600, 0.1):.0f} s")
