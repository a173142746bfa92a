"""Checker of the exercise that reads a published nccl-tests output (notebook 07): predict an all_reduce's time on
another number of GPUs from it.

The expected value is computed here from the output's own busbw column: nccl-tests defines busbw = algbw x 2(n-1)/n
for all_reduce so that it is independent of the number of ranks n (doc/PERFORMANCE.md), hence a call of S bytes on
n' ranks of the same kind takes S x 2(n'-1)/n' / busbw. Two real outputs are used (data/nccl_tests_all_reduce_*.txt):
8 GPUs driven by one process (nGpus 8), and 16 GPUs on two nodes, one process each (every process prints nGpus 1).
The n' asked stay inside each run's fabric: 2, 4, 8 GPUs of the one node; 16, or 8 split 4 + 4, on the two nodes.
Beyond it busbw does not carry over: NCCL may run another algorithm (on two nodes a tree can beat the network,
NVIDIA/nccl-tests issues 169 and 290), which the notebook's question asks about instead of the checker.
"""

from __future__ import annotations

import math

from ..costs import hardware as hw
from ..measure import nccl_tests
from .core import ExerciseFailed, call_learner, passed, with_hint

# (data file, what it is, [(size in bytes, ranks to predict for)]): the run's own n (its answer is in its table) and
# smaller n on the same fabric; sizes where out-of-place and in-place busbw agree within the 1% tolerance.
CASES = (
    ("nccl_tests_all_reduce_8xH100", "the 8-GPU output (one node)",
     [(1 << 30, 8), (1 << 30, 4), (1 << 30, 2), (2 << 30, 4)]),
    ("nccl_tests_all_reduce_2x8xH100", "the 16-GPU output (two nodes)",
     [(1 << 30, 16), (1 << 30, 8), (8 << 30, 8), (4 << 30, 16)]),
)
_ANSWER = ("course_lib.checks.nccl_tests._expected_seconds",)   # switched off while the learner's code runs
TOLERANCE = 0.01   # the printed columns are rounded to 4-5 digits (under 0.1%); 1% leaves room, no wrong method fits


def _expected_seconds(text: str, size: int, n: int) -> float:
    """S x 2(n-1)/n / busbw, busbw read off the out-of-place row of `size` in the output `text`."""
    row = next(r for r in nccl_tests.parse(text)["rows"]
               if r["size_bytes"] == size and r["placement"] == "out-of-place")
    return size * 2 * (n - 1) / n / (row["busbw_GBps"] * nccl_tests.GB)


def _seconds(got) -> float | None:
    """got as a positive finite float when it is one number (Python, numpy, or a one-element tensor), else None."""
    if isinstance(got, (bool, str, bytes)):
        return None
    try:
        x = float(got)
    except (TypeError, ValueError, RuntimeError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def check_predicted_time(predict_all_reduce_time, exercise: str = "Exercise 7.3") -> None:
    """predict_all_reduce_time(text, size, n) -> seconds of one all_reduce of `size` bytes on n GPUs, from an
    all_reduce_perf output `text`, assuming busbw at that size carries over; within 1% on both outputs."""
    hint = ("Which of the output's numbers did nccl-tests make independent of the number of ranks "
            "(doc/PERFORMANCE.md)? How many ranks ran (count them, do not trust nGpus alone), in which units are "
            "the columns (GB = 1e9 bytes, time in microseconds), and how many bytes does each rank move in an "
            "all_reduce on n ranks?")
    for name, what, cases in CASES:
        text = hw.nccl_tests_output(name)
        ran = nccl_tests.n_ranks(nccl_tests.parse(text))
        for size, n in cases:
            got = call_learner(exercise, predict_all_reduce_time, text, size, n, hint=hint, library=_ANSWER,
                               why="predicting a time from an nccl-tests output")
            seconds = _seconds(got)
            if seconds is None:
                raise ExerciseFailed(with_hint(f"{exercise}: on {what}, S = {size} bytes, n = {n}: return the time "
                                               f"in seconds as a positive number; you returned {got!r}.", hint))
            got = seconds
            if not math.isclose(got, _expected_seconds(text, size, n), rel_tol=TOLERANCE):
                same = (f" That run had {ran} ranks itself: for n = {ran} its table holds the answer."
                        if n == ran else "")
                raise ExerciseFailed(with_hint(f"{exercise}: on {what}, S = {size} bytes, n = {n}: you said "
                                               f"{got:.4g} s, which is not what that output's busbw implies.{same}",
                                               hint))
    return passed(exercise, "your predictions follow busbw on both outputs, for each run's own n and smaller ones")
