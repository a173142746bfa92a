"""Checkers of notebooks/01_why_distributed.ipynb: the memory wall (1.1), the compute wall (1.2) and the speed formula
at a fixed global batch (1.3). The expected values are computed here from data/ and course_lib.costs.hardware, never
written in a check cell; a wrong answer gets what was given and a hint at the method, not the number.
"""

from __future__ import annotations

import math
import numbers

from ..costs import hardware as hw
from .core import ExerciseFailed, call_learner, passed, with_hint


def _scalar(got):
    """A one-element array or tensor (numpy's or torch's) as the Python number it holds; anything else unchanged."""
    if not isinstance(got, (bool, numbers.Real)) and hasattr(got, "item"):
        try:
            return got.item()
        except (ValueError, RuntimeError):         # more than one element: not one number
            return got
    return got


def _number(exercise: str, got, what: str) -> float:
    """got as a float when it is one real number: Python's, numpy's (np.int64, np.float32, a 0-d array) or a
    one-element tensor."""
    got = _scalar(got)
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        raise ExerciseFailed(f"{exercise}: return {what} as a number; you returned {got!r}.")
    return float(got)


# ---------------------------------------------------------------- 1.1 and 1.2
def check_largest_model_on_a_server(largest_model, exercise: str = "Exercise 1.1") -> None:
    """The most parameters whose mixed-precision Adam state (16 bytes each, the ZeRO paper) fits on one server of 8
    H100 SXM 80GB, nothing else on the cards. The card's capacity is its real one: nvidia-smi's 81559 MiB
    (hw.memory_bytes), the 80 GiB of its name (0.4% more) or what CUDA reports, 81106 MiB (0.6% less); all within the
    1% allowed. 80e9 bytes (6.4% less) is not."""
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


# ---------------------------------------------------------------- 1.3
# LLaMA's recipe: 4M tokens per step of 2048-token sequences (Touvron et al. 2023, table 2) = 2048 sequences.
GLOBAL_BATCH = 2048
# The (link, smallest speedup ratio) pairs the learner's function is called with. Several, so that no constant passes;
# 400 GbE at 0.6 refuses a ratio written 1 - comm/compute (it gives 512 GPUs, not 1024), and 25 GbE at 0.99 refuses
# an all-reduce of 2·n·beta without the ring's (p-1)/p (it gives 1 GPU, not 2). The first is the statement's example.
# In every case the ring's latency term 2(p-1)·alpha cannot move the answer (400 GbE at 0.6: 0.666 at 1024 GPUs and
# 0.490 at 2048 with it, 0.674 and 0.508 without), so a bandwidth-only ring passes too: the links' alphas are orders
# of magnitude (data/links.csv), not measurements a verdict may rest on.
CASES = (("Ethernet 100 GbE", 0.85), ("Ethernet 400 GbE", 0.6), ("Ethernet 25 GbE", 0.99))
# hw.scaling(..., global_batch=...) splits the fixed batch over p GPUs for you: the very step exercise 1.3 asks for.
_STRONG_SCALING = ("course_lib.costs.hardware.scaling",)


def _at_fixed_batch(speed_setup, link: str, p: int) -> tuple[float, float]:
    """(speedup ratio, seconds per step) of LLaMA-7B on p GPUs over `link`, GLOBAL_BATCH / p sequences each."""
    setup = speed_setup("LLaMA-7B", link, GLOBAL_BATCH // p)
    r = hw.data_parallel_speed(p, *setup)
    return r["speedup_ratio"], setup[0] + r["comm_s"]


def _gpus(got):
    """64, np.int64(64), torch.tensor(64) and 64.0 are all 64 GPUs; anything else is returned as it came."""
    got = _scalar(got)
    if not isinstance(got, bool) and isinstance(got, numbers.Real) and float(got).is_integer():
        return int(got)
    return got


def check_gpus_at_fixed_batch(exercise_1_3, speed_setup, exercise: str = "Exercise 1.3") -> None:
    """exercise_1_3(link, min_ratio): the largest power-of-two number of GPUs p for LLaMA-7B over `link`, the global
    batch fixed at 2048 sequences (2048 / p per GPU), whose speedup ratio stays at min_ratio or more, and the seconds
    one step then takes; called for every pair in CASES and judged with the notebook's own speed_setup (the lesson's
    compute rate and link figures). hw.scaling is switched off while the learner's function runs (it splits the
    global batch itself); speed_setup and hw.data_parallel_speed stay allowed."""
    hint = ("With the global batch fixed, what happens to each GPU's share of the compute as p grows, and to the "
            "all-reduce's time? Which of the two does the speedup ratio compare, and where does it fall below the "
            "ratio asked for? speed_setup and hw.data_parallel_speed are allowed.")
    first = None
    for link, min_ratio in CASES:
        got = call_learner(exercise, exercise_1_3, link, min_ratio, hint=hint, library=_STRONG_SCALING,
                           why="splitting a fixed global batch over p GPUs (speed_setup and hw.data_parallel_speed "
                               "stay allowed)")
        case = f"{exercise}, {link} at a ratio of {min_ratio}"
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise ExerciseFailed(f"{case}: return two numbers, (GPUs, seconds per step); you returned {got!r}.")
        p, step = _gpus(got[0]), got[1]
        power_of_two = isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= GLOBAL_BATCH and p & (p - 1) == 0
        if not power_of_two:
            raise ExerciseFailed(with_hint(f"{case}: {p!r} GPUs does not split 2048 sequences evenly; give a power of "
                                           "two from 1 to 2048.", hint))
        ok = _at_fixed_batch(speed_setup, link, p)[0] >= min_ratio
        if not ok or (p < GLOBAL_BATCH and _at_fixed_batch(speed_setup, link, 2 * p)[0] >= min_ratio):
            raise ExerciseFailed(with_hint(f"{case}: {p} GPUs is not the largest power of two that keeps the speedup "
                                           f"ratio at {min_ratio} or more with 2048 sequences per step.", hint))
        step = _number(case, step, "the seconds per step")
        # 1%: rounding the inputs (a step read off a printed table), not a different formula; plus the ring's latency
        # term 2(p-1)·alpha, which a bandwidth-only ring leaves out (1.2% of the step at 1024 GPUs over 400 GbE). A
        # step without its all-reduce is 11% short at 64 GPUs over 100 GbE.
        want = _at_fixed_batch(speed_setup, link, p)[1]
        latency = 2 * (p - 1) * speed_setup("LLaMA-7B", link, GLOBAL_BATCH // p)[2]
        if not abs(step - want) <= 0.01 * want + latency:
            raise ExerciseFailed(with_hint(f"{case}: {p} GPUs is right, but {step:.3g} s is not one step's compute "
                                           f"of {GLOBAL_BATCH // p} sequences plus its all-reduce.", hint))
        first = first or (link, min_ratio, p, step)
    link, min_ratio, p, step = first
    return passed(exercise, f"over {link} at a ratio of {min_ratio}: {p} GPUs, {GLOBAL_BATCH // p} sequences each, "
                            f"{step:.1f} s per step (and right for the {len(CASES) - 1} other links and ratios tried)")
