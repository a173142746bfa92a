"""Checkers of notebook 02's exercises (notebooks/02_cluster_architecture.ipynb): a link's transfer time, a ToR's
oversubscription, and how many parameter servers catch a ring all-reduce.

Each expected value is computed here from data/ (links.csv, training_runs.csv) and the formulas the notebook states,
never written in a check cell. While the learner's function runs, the course functions that hold the answer are
switched off (the ones the notebook itself calls, and this module's own references), so the arithmetic is the
learner's. A wrong answer gets what was given and a hint at the method, not the number.
"""

from __future__ import annotations

import math
import numbers

from ..costs import hardware as hw
from .core import ExerciseFailed, call_learner, passed, with_hint


def _plain(got):
    """A 0-d tensor or numpy scalar as the Python number it holds; anything else unchanged."""
    return got.item() if hasattr(got, "item") and getattr(got, "ndim", None) == 0 else got


def _number(exercise, got, what):
    got = _plain(got)
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
        raise ExerciseFailed(f"{exercise}: return {what} as a number; you returned {got!r}.")
    return got


# ---------------------------------------------------------------- Exercise 2.1
_TRANSFER = ("course_lib.costs.hardware.transfer_time_s", "course_lib.costs.hardware.gradient_transfer_table",
             "course_lib.checks.cluster._transfer_s")


def _transfer_s() -> float:
    """LLaMA-65B's fp16 gradients (2 bytes per parameter, data/training_runs.csv) over PCIe 4.0 x16 in one direction
    (data/links.csv: 31.5 GB/s, 16 GT/s x 16 lanes x 128/130 / 8)."""
    n_bytes = 2 * hw.row("training_runs", "LLaMA-65B")["params"]
    return n_bytes / (hw.row("links", "PCIe 4.0 x16")["GBps_one_direction"] * 1e9)


def check_gradient_transfer(exercise_2_1, exercise: str = "Exercise 2.1") -> None:
    """Seconds to send LLaMA-65B's fp16 gradients once over PCIe 4.0 x16, one direction, from the notebook's tables.
    Tolerance 0.1%: the inputs are exact table entries, so only rounding differs; 65e9 parameters instead of the
    table's 65.2e9 (0.3%), 32 GB/s without PCIe's 128b/130b encoding (1.6%) or GiB for GB (7%) are other answers."""
    hint = ("How many bytes is one fp16 gradient, how many parameters does data/training_runs.csv give LLaMA-65B, and "
            "how many bytes per second does data/links.csv give PCIe 4.0 x16 in one direction (GB = 1e9 bytes)?")
    got = _number(exercise, call_learner(exercise, exercise_2_1, hint=hint, library=_TRANSFER,
                                         why="turning bytes and a link's speed into seconds"), "seconds")
    if not math.isclose(got, _transfer_s(), rel_tol=1e-3):
        raise ExerciseFailed(with_hint(f"{exercise}: you said {got:.3g} s.", hint))
    return passed(exercise, f"{got:.2f} s")


# ---------------------------------------------------------------- Exercise 2.2
TOR_CASES = ((4, 8, 8), (3, 4, 4), (2, 8, 16), (4, 8, 64), (6, 8, 12))   # (servers, GPUs each, ToR uplinks)


def _tor_share(servers: int, gpus: int, uplinks: int) -> tuple[float, float]:
    """(the ToR's oversubscription ratio, GB/s each way a GPU keeps when every GPU of the rack leaves it at once):
    every NIC and uplink InfiniBand NDR; a GPU never gets more than its own NIC."""
    nic = hw.row("links", "InfiniBand NDR")["GBps_one_direction"]
    ratio = servers * gpus / uplinks
    return ratio, nic / max(ratio, 1.0)


def check_tor_share(tor_share, exercise: str = "Exercise 2.2") -> None:
    """``tor_share(servers, gpus_per_server, uplinks)`` for racks whose GPUs' NDR NICs all cable into one ToR with
    ``uplinks`` NDR links up: (oversubscription ratio, GB/s each way per GPU with every GPU leaving the rack)."""
    hint = ("How many NICs plug into the ToR from below, and how many links leave it upwards? When every GPU sends "
            "out of the rack at once, who shares the uplinks, and can a GPU ever send faster than its own NIC?")
    for case in TOR_CASES:
        got = call_learner(exercise, tor_share, *case, hint=hint, library=("course_lib.checks.cluster._tor_share",),
                           why="a ToR's oversubscription")
        want = _tor_share(*case)
        got = [_plain(g) for g in got] if isinstance(got, (tuple, list)) else got
        if not (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(g, (int, float)) and not isinstance(g, bool) for g in got)):
            raise ExerciseFailed(f"{exercise}: return two numbers, (ratio, GB/s per GPU); you returned {got!r}.")
        if not all(math.isclose(g, w, rel_tol=1e-3) for g, w in zip(got, want)):
            servers, gpus, uplinks = case
            raise ExerciseFailed(with_hint(f"{exercise}: with {servers} servers of {gpus} GPUs and {uplinks} "
                                           f"uplinks you returned {tuple(got)}.", hint))
    return passed(exercise, f"{len(TOR_CASES)} racks, from {min(_tor_share(*c)[0] for c in TOR_CASES):g}:1 to "
                            f"{max(_tor_share(*c)[0] for c in TOR_CASES):g}:1")


# ---------------------------------------------------------------- Exercise 2.3
# Odd and even n: n // 2 + 1 happens to be right for every even n, wrong for odd n. No n here has a tie
# (n^2 / (2(n-1)) is an integer only for n = 2), so float rounding cannot move the answer.
WORKERS = (3, 5, 16, 33, 64)
_PS_FORMULAS = ("course_lib.costs.alpha_beta.ps_vs_allreduce", "course_lib.costs.alpha_beta.byteps_optimal",
                "course_lib.checks.cluster._fewest_servers")


def _fewest_servers(n: int) -> int:
    """Smallest k with the PS step no slower than the ring (section 4, BytePS's analysis, push and pull overlapped):
    max(M/B, nM/(kB)) <= 2(n-1)M/(nB). M/B cancels; in integers: n * n <= 2 (n - 1) k, the worker's own M/B being
    below the ring's for n >= 2."""
    return next(k for k in range(1, n + 1) if n * n <= 2 * (n - 1) * k)


def check_ps_servers_needed(ps_servers_needed, exercise: str = "Exercise 2.3") -> None:
    """``ps_servers_needed(n)``: the fewest parameter servers on machines of their own (each holding 1/k of the
    parameters) for which the PS step on n workers is no slower than the ring all-reduce, for several n."""
    hint = ("How many bytes cross a worker's NIC in each direction, and a server's, when k servers each hold 1/k of "
            "the parameters? The step lasts as long as the busiest NIC needs (push and pull overlap, as in section "
            "4); compare that with the ring's 2(n-1)/n M/B.")
    for n in WORKERS:
        got = _plain(call_learner(exercise, ps_servers_needed, n, hint=hint, library=_PS_FORMULAS,
                                  why="the traffic on a parameter server's NIC"))
        if isinstance(got, bool) or not isinstance(got, numbers.Real) or not float(got).is_integer():
            raise ExerciseFailed(f"{exercise}: return a whole number of servers; for n = {n} you returned {got!r}.")
        if int(got) != _fewest_servers(n):
            raise ExerciseFailed(with_hint(f"{exercise}: for n = {n} workers you said k = {int(got)}: with that many "
                                           "servers the PS is either still slower than the ring, or fewer would "
                                           "do.", hint))
    return passed(exercise, f"right for n = {', '.join(map(str, WORKERS))}; 16 workers need "
                            f"{_fewest_servers(16)} servers")
