"""Checkers for the exercises that estimate a number from the course's tables and formulas (notebooks 01, 02, 07,
16): the expected value is computed here from data/ and course_lib's formulas, never written in a check cell.

A wrong answer gets what was given and a hint at the method, not the number.
"""

from __future__ import annotations

import math

from .. import costmodel
from .. import hardware as hw
from .core import ExerciseFailed, call_learner, passed, with_hint


def _number(exercise, got, what):
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise ExerciseFailed(f"{exercise}: return {what} as a number; you returned {got!r}.")
    return got


# ---------------------------------------------------------------- notebook 01
def check_cards_for_llama(exercise_1_1, exercise: str = "Exercise 1.1") -> None:
    """Cards of H100 SXM 80GB just to hold LLaMA-65B's mixed-precision Adam state (data/training_runs.csv).

    The card's capacity is its real one: nvidia-smi's 81559 MiB (hw.memory_bytes), or the 80 GiB of its name; both give
    the same count. 80e9 bytes (the name read as decimal GB) does not.
    """
    hint = ("How many bytes per parameter does mixed-precision Adam keep (the ZeRO paper counts them), and how many "
            "bytes does one card really hold: what does nvidia-smi say an '80 GB' card has?")
    got = _number(exercise, call_learner(exercise, exercise_1_1, hint=hint), "the number of cards")
    state = hw.training_state_bytes(hw.row("training_runs", "LLaMA-65B")["params"], "mixed")["total"]
    card = hw.row("accelerators", "H100 SXM 80GB")
    accepted = {hw.gpus_to_hold(state, card), math.ceil(state / (card["memory_GB"] * hw.GiB))}
    if got not in accepted:
        unit = math.ceil(state / (card["memory_GB"] * hw.GB))
        why = (" An \"80GB\" card holds 80 GiB (80 x 2**30 bytes; nvidia-smi shows 81559 MiB), not 80e9 bytes."
               if got == unit and unit not in accepted else "")
        raise ExerciseFailed(with_hint(f"{exercise}: you said {got} cards, which is not the smallest number that "
                                       f"holds the state.{why}", hint))
    return passed(exercise, f"{got} cards")


def check_bloom_days(exercise_1_2, exercise: str = "Exercise 1.2") -> None:
    """Days of pure compute for BLOOM-176B: 6·N·D / (GPUs x FLOP/s per GPU), from data/training_runs.csv."""
    hint = ("About how many FLOPs does training take per parameter and per token, how many FLOP/s did all of BLOOM's "
            "GPUs sustain together, and how many seconds make a day?")
    got = _number(exercise, call_learner(exercise, exercise_1_2, hint=hint), "the number of days")
    b = hw.row("training_runs", "BLOOM-176B")
    want = hw.training_flops(b["params"], b["tokens"]) / (b["gpus"] * b["tflops_per_gpu"] * 1e12) / 86400
    if not math.isclose(got, want, rel_tol=0.01):     # 1%: rounding the inputs, not a different formula
        raise ExerciseFailed(with_hint(f"{exercise}: you said {got:.1f} days; that is not 6·N·D at BLOOM's measured "
                                       "rate on its GPUs.", hint))
    return passed(exercise, f"{got:.1f} days of pure compute vs ~{b['duration_days']} days of wall time "
                            f"(11 March to early July 2022)")


# LLaMA's recipe: 4M tokens per step of 2048-token sequences (Touvron et al. 2023, table 2) = 2048 sequences.
GLOBAL_BATCH = 2048
MIN_RATIO = 0.85


def _at_fixed_batch(speed_setup, p: int) -> tuple[float, float]:
    """(speedup ratio, seconds per step) of LLaMA-7B on p GPUs over Ethernet 100 GbE, GLOBAL_BATCH / p sequences
    each."""
    setup = speed_setup("LLaMA-7B", "Ethernet 100 GbE", GLOBAL_BATCH // p)
    r = hw.data_parallel_speed(p, *setup)
    return r["speedup_ratio"], setup[0] + r["comm_s"]


def check_gpus_at_fixed_batch(exercise_1_3, speed_setup, exercise: str = "Exercise 1.3") -> None:
    """Largest power-of-two number of GPUs p for LLaMA-7B over Ethernet 100 GbE, the global batch fixed at 2048
    sequences (2048 / p per GPU), whose speedup ratio stays at 0.85 or more, and the seconds one step then takes;
    judged with the notebook's own speed_setup (the lesson's compute rate and link figures)."""
    hint = ("With the global batch fixed, what happens to each GPU's share of the compute as p grows, and to the "
            "all-reduce's time? Which of the two does the speedup ratio compare, and where does it fall below 0.85?")
    got = call_learner(exercise, exercise_1_3, hint=hint)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise ExerciseFailed(f"{exercise}: return two numbers, (GPUs, seconds per step); you returned {got!r}.")
    p, step = got
    power_of_two = isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= GLOBAL_BATCH and p & (p - 1) == 0
    if not power_of_two:
        raise ExerciseFailed(with_hint(f"{exercise}: {p!r} GPUs does not split 2048 sequences evenly; give a power of "
                                       "two from 1 to 2048.", hint))
    ok = _at_fixed_batch(speed_setup, p)[0] >= MIN_RATIO
    if not ok or (p < GLOBAL_BATCH and _at_fixed_batch(speed_setup, 2 * p)[0] >= MIN_RATIO):
        raise ExerciseFailed(with_hint(f"{exercise}: {p} GPUs is not the largest power of two that keeps the speedup "
                                       "ratio at 0.85 or more with 2048 sequences per step.", hint))
    step = _number(exercise, step, "the seconds per step")
    if not math.isclose(step, _at_fixed_batch(speed_setup, p)[1], rel_tol=0.01):
        raise ExerciseFailed(with_hint(f"{exercise}: {p} GPUs is right, but {step:.3g} s is not one step's compute "
                                       f"of {GLOBAL_BATCH // p} sequences plus its all-reduce.", hint))
    return passed(exercise, f"{p} GPUs, {GLOBAL_BATCH // p} sequences each, {step:.1f} s per step: the global batch is "
                            f"still {GLOBAL_BATCH} sequences")


# ---------------------------------------------------------------- notebook 02
def check_gradient_transfer(exercise_2_1, exercise: str = "Exercise 2.1") -> None:
    """Seconds to send LLaMA-65B's fp16 gradients once over PCIe 4.0 x16 (data/links.csv)."""
    hint = "How many bytes is one fp16 gradient per parameter, and how fast does the link move bytes in one direction?"
    got = _number(exercise, call_learner(exercise, exercise_2_1, hint=hint), "seconds")
    want = hw.transfer_time_s(2 * hw.row("training_runs", "LLaMA-65B")["params"], "PCIe 4.0 x16")
    if not math.isclose(got, want, rel_tol=1e-3):
        raise ExerciseFailed(with_hint(f"{exercise}: you said {got:.3g} s.", hint))
    return passed(exercise, f"{got:.2f} s")


def check_tor_edges(exercise_2_2, exercise: str = "Exercise 2.2") -> None:
    """Edges of topology.rack(6)'s description that reach its ToR switch."""
    from ..viz import topology

    hint = "Which edges of the rack touch the ToR switch, and does it matter at which end of an edge the switch is?"
    got = call_learner(exercise, exercise_2_2, hint=hint)
    want = sum("tor0" in (e["a"], e["b"]) for e in topology.rack(6)["edges"])
    if got != want:
        raise ExerciseFailed(with_hint(f"{exercise}: you counted {got!r} edges.", hint))
    return passed(exercise, f"{got} edges reach the ToR switch")


def _fewest_servers(n: int) -> int:
    """Smallest k with costmodel's PS time <= ring all-reduce's (M and B cancel: both scale as M/B)."""
    return next(k for k in range(1, n + 1)
                if costmodel.ps_vs_allreduce(n, 1.0, 1.0, k)["ps_s"]
                <= costmodel.ps_vs_allreduce(n, 1.0, 1.0, k)["allreduce_s"] * (1 + 1e-12))


def check_servers_for_16(exercise_2_3, exercise: str = "Exercise 2.3") -> None:
    """Fewest non-colocated parameter servers (BytePS) for 16 workers to be no slower than the ring."""
    hint = ("How does the busiest link's traffic change as servers are added, and at which number of servers is it "
            "no busier than a link of the ring?")
    got = call_learner(exercise, exercise_2_3, hint=hint)
    if got != _fewest_servers(16):
        raise ExerciseFailed(with_hint(f"{exercise}: with k = {got!r} the PS is either still slower than the ring "
                                       "or k is not the smallest that is not.", hint))
    return passed(exercise, f"k = {got}")


# ---------------------------------------------------------------- notebook 07
def check_all_gather_bandwidths(all_gather_bandwidths, exercise: str = "Exercise 7.1") -> None:
    """(algbw, busbw) in GB/s of an all_gather on 8 ranks, S = 1 GiB of output, in 10 ms (nccl-tests' definitions,
    doc/PERFORMANCE.md: algbw = S/t, busbw = algbw x (n-1)/n for all_gather)."""
    hint = ("Which size does nccl-tests divide by for algbw, in which units (GiB or GB), and how does it turn "
            "all_gather's algbw into a bus bandwidth (its doc/PERFORMANCE.md)?")
    got = call_learner(exercise, all_gather_bandwidths, hint=hint)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise ExerciseFailed(f"{exercise}: return two numbers, (algbw, busbw); you returned {got!r}.")
    algbw = (1 << 30) / 10e-3 / 1e9
    if not math.isclose(got[0], algbw, rel_tol=1e-4):
        raise ExerciseFailed(with_hint(f"{exercise}: your algbw {got[0]:.4g} GB/s is not S/t.", hint))
    if not math.isclose(got[1], algbw * 7 / 8, rel_tol=1e-4):
        raise ExerciseFailed(with_hint(f"{exercise}: your busbw {got[1]:.4g} GB/s does not use all_gather's factor "
                                       "for 8 ranks.", hint))
    return passed(exercise, f"algbw {got[0]:.1f} GB/s, busbw {got[1]:.1f} GB/s")


def check_course_ring_fit(fit_course_ring, rows, exercise: str = "Exercise 7.2") -> None:
    """(alpha, beta) of the course ring's rows (op 'ring') of the measured sweep, fitted with the ring's model."""
    hint = ("Which rows are the course's ring, in which units are their sizes and times, and what does the ring's "
            "model say one call of n bytes costs on p ranks?")
    got = call_learner(exercise, fit_course_ring, rows, hint=hint)
    ring = [r for r in rows if r["op"] == "ring"]
    want = costmodel.fit_alpha_beta([r["size_bytes"] for r in ring], [r["time_us"] / 1e6 for r in ring],
                                    p=ring[0]["ranks"], algorithm="ring")
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-12) for g, w in zip(got, want))):
        raise ExerciseFailed(with_hint(f"{exercise}: you returned {got!r}, not the ring model's fit of the ring "
                                       "rows (times in seconds, sizes in bytes).", hint))
    return passed(exercise, f"course ring alpha {got[0] * 1e6:.0f} us, 1/beta {1 / got[1] / 1e9:.2f} GB/s")


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


def check_checkpoint_interval(checkpoint_interval_s, exercise: str = "Exercise 16.2") -> None:
    """Young's interval sqrt(2 C M) in seconds (CACM 17(9), 1974), M = 1 / (n x Llama 3's rate per GPU-day)."""
    hint = ("What is the mean time between failures of that many GPUs, in seconds, and which two costs does Young's "
            "interval balance? If exercise 16.1 is wrong, fix it first.")
    for save_s, n in ((60, 16384), (10, 1024), (300, 100_000)):
        got = _number(exercise, call_learner(exercise, checkpoint_interval_s, save_s, n, hint=hint), "seconds")
        want = math.sqrt(2 * save_s * 86400 / (n * _per_gpu_day()))
        if not math.isclose(got, want, rel_tol=1e-6):
            raise ExerciseFailed(with_hint(f"{exercise}: {save_s} s per save on {n} GPUs: you said {got:.4g} s.",
                                           hint))
    return passed(exercise, f"checkpoint every {checkpoint_interval_s(60, 16384) / 60:.0f} min at 16,384 GPUs")
