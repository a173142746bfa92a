"""Checkers for the exercises that estimate a number from the course's tables and formulas (notebooks 01, 07, 16;
notebook 02's are in cluster.py): the expected value is computed here from data/ and course_lib's formulas, never
written in a check cell.

A wrong answer gets what was given and a hint at the method, not the number.
"""

from __future__ import annotations

import math
import numbers

from ..bench.collectives import FACTORS
from ..costs import alpha_beta
from ..costs import hardware as hw
from .core import ExerciseFailed, call_learner, passed, with_hint


def _number(exercise, got, what):
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise ExerciseFailed(f"{exercise}: return {what} as a number; you returned {got!r}.")
    return got


# ---------------------------------------------------------------- notebook 01
def check_largest_model_on_a_server(largest_model, exercise: str = "Exercise 1.1") -> None:
    """The most parameters whose mixed-precision Adam state (16 bytes each, the ZeRO paper) fits on one server of 8
    H100 SXM 80GB, nothing else on the cards. The card's capacity is its real one: nvidia-smi's 81559 MiB
    (hw.memory_bytes) or the 80 GiB of its name (0.4% apart, both within the 1% allowed); 80e9 bytes is not."""
    hint = ("How many bytes per parameter does mixed-precision Adam keep (the ZeRO paper counts them), and how many "
            "bytes do eight cards really hold: what does nvidia-smi say an '80 GB' card has?")
    got = _number(exercise, call_learner(exercise, largest_model, hint=hint), "the number of parameters")
    per_param = hw.training_state_bytes(1, "mixed")["total"]
    want = 8 * hw.memory_bytes(hw.row("accelerators", "H100 SXM 80GB")) / per_param
    if not math.isclose(got, want, rel_tol=0.01):
        raise ExerciseFailed(with_hint(f"{exercise}: you said {got:.4g} parameters; that is not the largest state "
                                       "that eight such cards hold.", hint))
    return passed(exercise, f"{got / 1e9:.1f} billion parameters")


def check_bloom_mfu(bloom_mfu, exercise: str = "Exercise 1.2") -> None:
    """The MFU BLOOM-176B averaged over its whole run: 6·N·D over its reported GPU-hours, as a fraction of its
    A100 80GB's bf16 peak (data/training_runs.csv, data/accelerators.csv)."""
    hint = ("How many FLOPs did the run need, how many GPU-seconds did it report, and what does one GPU do per second "
            "at its peak? Is the ~150 TFLOP/s the run reported an average over the whole run, and does it count only "
            "6·N·D?")
    got = _number(exercise, call_learner(exercise, bloom_mfu, hint=hint), "the fraction")
    b = hw.row("training_runs", "BLOOM-176B")
    peak = hw.row("accelerators", b["gpu_type"])["bf16_dense_TFLOPS"] * 1e12
    want = hw.training_flops(b["params"], b["tokens"]) / (b["gpu_hours"] * 3600) / peak
    if not math.isclose(got, want, rel_tol=0.01):     # 1%: rounding the inputs, not a different formula
        raise ExerciseFailed(with_hint(f"{exercise}: you said {got:.3g}; that is not 6·N·D over BLOOM's reported "
                                       "GPU-hours, as a fraction of the peak.", hint))
    return passed(exercise, f"an MFU of {got:.1%} averaged over the whole run")


# LLaMA's recipe: 4M tokens per step of 2048-token sequences (Touvron et al. 2023, table 2) = 2048 sequences.
GLOBAL_BATCH = 2048
MIN_RATIO = 0.85
# hw.scaling(..., global_batch=...) splits the fixed batch over p GPUs for you: the very step exercise 1.3 asks for.
_STRONG_SCALING = ("course_lib.costs.hardware.scaling",)


def _at_fixed_batch(speed_setup, p: int) -> tuple[float, float]:
    """(speedup ratio, seconds per step) of LLaMA-7B on p GPUs over Ethernet 100 GbE, GLOBAL_BATCH / p sequences
    each."""
    setup = speed_setup("LLaMA-7B", "Ethernet 100 GbE", GLOBAL_BATCH // p)
    r = hw.data_parallel_speed(p, *setup)
    return r["speedup_ratio"], setup[0] + r["comm_s"]


def check_gpus_at_fixed_batch(exercise_1_3, speed_setup, exercise: str = "Exercise 1.3") -> None:
    """Largest power-of-two number of GPUs p for LLaMA-7B over Ethernet 100 GbE, the global batch fixed at 2048
    sequences (2048 / p per GPU), whose speedup ratio stays at 0.85 or more, and the seconds one step then takes;
    judged with the notebook's own speed_setup (the lesson's compute rate and link figures). hw.scaling is switched
    off while the learner's function runs (it splits the global batch itself); speed_setup and hw.data_parallel_speed
    stay allowed."""
    hint = ("With the global batch fixed, what happens to each GPU's share of the compute as p grows, and to the "
            "all-reduce's time? Which of the two does the speedup ratio compare, and where does it fall below 0.85? "
            "speed_setup and hw.data_parallel_speed are allowed.")
    got = call_learner(exercise, exercise_1_3, hint=hint, library=_STRONG_SCALING,
                       why="splitting a fixed global batch over p GPUs (use speed_setup and hw.data_parallel_speed)")
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise ExerciseFailed(f"{exercise}: return two numbers, (GPUs, seconds per step); you returned {got!r}.")
    p, step = got
    if not isinstance(p, bool) and isinstance(p, numbers.Real) and float(p).is_integer():
        p = int(p)                          # 64, np.int64(64) and 64.0 are all 64 GPUs
    power_of_two = isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= GLOBAL_BATCH and p & (p - 1) == 0
    if not power_of_two:
        raise ExerciseFailed(with_hint(f"{exercise}: {p!r} GPUs does not split 2048 sequences evenly; give a power of "
                                       "two from 1 to 2048.", hint))
    ok = _at_fixed_batch(speed_setup, p)[0] >= MIN_RATIO
    if not ok or (p < GLOBAL_BATCH and _at_fixed_batch(speed_setup, 2 * p)[0] >= MIN_RATIO):
        raise ExerciseFailed(with_hint(f"{exercise}: {p} GPUs is not the largest power of two that keeps the speedup "
                                       "ratio at 0.85 or more with 2048 sequences per step.", hint))
    step = _number(exercise, step, "the seconds per step")
    # 1%: rounding the inputs (a step read off a printed table), not a different formula; a step without its
    # all-reduce is 11% short at 64 GPUs
    if not math.isclose(step, _at_fixed_batch(speed_setup, p)[1], rel_tol=0.01):
        raise ExerciseFailed(with_hint(f"{exercise}: {p} GPUs is right, but {step:.3g} s is not one step's compute "
                                       f"of {GLOBAL_BATCH // p} sequences plus its all-reduce.", hint))
    return passed(exercise, f"{p} GPUs, {GLOBAL_BATCH // p} sequences each, {step:.1f} s per step: the global batch is "
                            f"still {GLOBAL_BATCH} sequences")


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


def check_interruptions_per_day(interruptions_per_day, exercise: str = "Exercise 16.1") -> None:
    """Expected unexpected interruptions per day on n GPUs at Llama 3's per-GPU rate (data/failure_rates.csv)."""
    hint = ("Over how many days and how many GPUs did Llama 3 count its unexpected interruptions, and how does the "
            "rate grow with the number of GPUs?")
    for n in (1, 1024, 16384, 100_000):
        got = _number(exercise, call_learner(exercise, interruptions_per_day, n, hint=hint), "a rate")
        if not math.isclose(got, n * _per_gpu_day(), rel_tol=1e-9):
            raise ExerciseFailed(with_hint(f"{exercise}: for {n} GPUs you said {got:.4g} per day.", hint))
    return passed(exercise, "right for 1 to 100,000 GPUs")


def _max_save_s(gpus: int, restart_s: float, waste: float) -> float:
    """The longest save C with C/T + T/(2M) + R/M <= waste at Young's T = sqrt(2CM) (CACM 17(9), 1974): there the
    two terms are equal, sqrt(C/(2M)) each, so sqrt(2C/M) <= waste - R/M; 0 when R/M alone exceeds the budget."""
    mtbf_s = 86400 / (gpus * _per_gpu_day())
    left = waste - restart_s / mtbf_s
    return mtbf_s * left * left / 2 if left > 0 else 0.0


def check_max_save_s(max_save_s, exercise: str = "Exercise 16.2") -> None:
    """The longest checkpoint save, in seconds, that keeps what a job on n GPUs loses (saves, work redone, restarts)
    within a budget when it checkpoints at Young's interval, at Llama 3's rate per GPU (data/failure_rates.csv)."""
    hint = ("What is the mean time M between interruptions of that many GPUs, in seconds? What do the two terms "
            "C/T + T/(2M) add up to at Young's T = sqrt(2CM), and what is left of the budget once every "
            "interruption has paid its restart? If exercise 16.1 is wrong, fix it first.")
    for gpus, restart_s, waste in ((16384, 600, 0.1), (1024, 300, 0.05), (100_000, 60, 0.1), (8, 3600, 0.01),
                                   (100_000, 600, 0.1)):
        got = _number(exercise, call_learner(exercise, max_save_s, gpus, restart_s, waste, hint=hint), "seconds")
        want = _max_save_s(gpus, restart_s, waste)
        if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9):
            why = " (can a save take less than no time?)" if got < 0 else ""
            raise ExerciseFailed(with_hint(f"{exercise}: {gpus} GPUs, {restart_s} s per restart, at most "
                                           f"{waste:.0%} lost: you said {got:.4g} s{why}.", hint))
    return passed(exercise, f"a 16,384-GPU job with 10-minute restarts keeps 90% if a save takes at most "
                            f"{max_save_s(16384, 600, 0.1):.0f} s")
