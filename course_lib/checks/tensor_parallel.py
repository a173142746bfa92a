"""Checkers for the exercises of notebook 13 (tensor parallelism, Megatron-LM: Shoeybi et al. 2019, section 3).

Each runs the learner's function on real ranks, every rank with the same full nn.Linear and input, and compares
with nn.Linear itself; CommLog (course_lib/measure/comm_log.py) counts the collectives the learner's code ran.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..launch import run
from ..measure.comm_log import CommLog
from ..results import RankFailed
from .core import ExerciseFailed

CASES = [(2, 6, 8), (3, 6, 12)]     # (world size, in features, out features): even and odd p, each divides evenly


def _launch(exercise, fn, world, args, hint):
    try:
        return run(fn, world_size=world, args=args, output="none", timeout=30).values
    except RankFailed as e:
        if e.failure.etype == "NotImplementedError":   # a student copy: the exercise is not done yet
            raise NotImplementedError(f"{exercise}: {e.failure.message}") from None
        raise ExerciseFailed(f"{exercise}: rank {e.rank} failed with {world} ranks:\n{e}\nHint: {hint}") from None


def _case(learner, n_in, n_out, batch=5):
    """On every rank: the same layer and input (same seed), the learner's answer, nn.Linear's, the calls logged."""
    from ..devices import device
    torch.manual_seed(0)
    linear = nn.Linear(n_in, n_out).to(device())
    with torch.no_grad():
        linear.bias += 1.0                       # a bias far from zero: adding it on every rank shows
        x = torch.randn(batch, n_in, device=device())
        want = linear(x)
        with CommLog() as log:
            got = learner(x, linear)
    got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
    return {"want": want.cpu(), "got": got, "calls": [(c.op, c.size) for c in log.calls], "rank": dist.get_rank(),
            "bias": linear.bias.detach().cpu()}


def _compare(exercise, world, vals, expect, hint, diagnose=None):
    """Every rank's answer against expect(nn.Linear's output, rank, world); yields each rank's logged calls."""
    for v in vals:
        case, want, got = f"{world} ranks, rank {v['rank']}", expect(v["want"], v["rank"], world), v["got"]
        if not isinstance(got, torch.Tensor):
            raise ExerciseFailed(f"{exercise}: {case}: you returned {type(got).__name__}, not a tensor.\nHint: {hint}")
        if got.shape != want.shape:
            raise ExerciseFailed(f"{exercise}: {case}: your output has shape {tuple(got.shape)}, expected "
                                 f"{tuple(want.shape)}.\nHint: {hint}")
        if not torch.allclose(got, want, atol=1e-5):
            extra = (diagnose(v, world) or "") if diagnose else ""
            raise ExerciseFailed(f"{exercise}: {case}: wrong values, off by up to "
                                 f"{(got - want).abs().max().item():.3g}.{extra}\nHint: {hint}")
        yield v["calls"]


def check_column_parallel_forward(column_parallel_forward,
                                  exercise: str = "Exercise 13.1 (column-parallel forward)") -> None:
    """`column_parallel_forward(x, linear)` -> this rank's slice of linear(x) (its out_features / p output columns),
    computed from its slice of the weight with no communication; checked on 2 and 3 real ranks."""
    hint = ("rank r owns output features r*k..(r+1)*k with k = out_features // world size: rows of linear.weight "
            "(shape out x in) and entries of linear.bias; x @ w_r.T + b_r, no collective needed")
    for world, n_in, n_out in CASES:
        vals = _launch(exercise, _case, world, (column_parallel_forward, n_in, n_out), hint)
        for calls in _compare(exercise, world, vals, lambda y, r, p: y.chunk(p, dim=1)[r], hint):
            if calls:
                raise ExerciseFailed(f"{exercise}: your function ran {[c[0] for c in calls]}; a column-parallel "
                                     f"forward needs no communication at all.\nHint: {hint}")
    print(f"PASS {exercise}: every rank's output columns equal nn.Linear's on 2 and 3 ranks, with no communication")


def _bias_counted(v, world):
    if v["got"].shape == v["want"].shape and torch.allclose(v["got"], v["want"] + (world - 1) * v["bias"], atol=1e-4):
        return (f" Your result is nn.Linear's plus {world - 1} extra biases: the bias was added on every rank before "
                f"the all-reduce, so the sum holds it {world} times.")
    return None


def check_row_parallel_linear(row_parallel_linear, exercise: str = "Exercise 13.2 (row-parallel linear)") -> None:
    """`row_parallel_linear(x, linear)` -> linear(x) on every rank, from this rank's in_features / p input columns
    and weight columns, ONE all_reduce of the batch x out partial sums, the bias added once; 2 and 3 ranks."""
    hint = ("rank r owns input features r*k..(r+1)*k (k = in_features // world size): x[:, s] @ linear.weight[:, s].T "
            "is a partial sum; dist.all_reduce it, then add linear.bias once (after the all-reduce)")
    for world, n_in, n_out in CASES:
        vals = _launch(exercise, _case, world, (row_parallel_linear, n_in, n_out), hint)
        for calls in _compare(exercise, world, vals, lambda y, r, p: y, hint, _bias_counted):
            want = [("all_reduce", 5 * n_out * 4)]
            if calls != want:
                raise ExerciseFailed(f"{exercise}: {world} ranks: your function ran {calls} (op, bytes); expected "
                                     f"exactly one all_reduce of the 5 x {n_out} float32 partial sums, "
                                     f"{want[0][1]} bytes.\nHint: {hint}")
    print(f"PASS {exercise}: linear(x) on every rank for 2 and 3 ranks, with exactly one all_reduce")
