"""Checkers for the exercises of notebooks/00_start_here.ipynb: one all-reduce with the right reduction.

Each runs the learner's function on 2-5 real ranks against torch's own result (core.check_collective); the
reference and the inputs live here, not in the notebook, so the check cell shows no answer.
"""

from __future__ import annotations

import torch

from .core import check_collective
from .traffic import summary


def rank_values(rank: int, world_size: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Values that differ by rank and element, negative ones included, so MAX, SUM and a copy all differ."""
    return ((torch.arange(size) * (rank + 3)) % 7 - rank).to(dtype)


def _torch_max(x):
    import torch.distributed as dist

    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def _mean_of_everyone(x):
    """The mean computed another way than the exercise asks (gather everything, average in one process)."""
    import torch.distributed as dist

    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)
    return torch.stack(everyone).mean(dim=0)


def check_all_max(all_max, exercise: str = "Exercise 0.1") -> None:
    """``all_max(x)``: every rank's x becomes the element-wise maximum over ranks (in place), and is returned."""
    return check_collective(exercise, all_max, _torch_max, rank_values, world_sizes=(2, 3, 4, 5), sizes=(1, 5),
                            in_place=True,
                            hint=("Which reduction makes every rank end with the largest value? Look at the arguments "
                                  "dist.all_reduce takes."))


def _one_sum_all_reduce(case, records):
    for rec in records:
        calls = [(name, op) for name, _, _, op in rec["collectives"]]
        if calls != [("all_reduce", "SUM")]:
            return (f"rank {rec['rank']} ran {calls or 'no collective'} (collective, reduction); the exercise asks "
                    "for one all_reduce with ReduceOp.SUM, then a division on every rank (ReduceOp.AVG is not "
                    "available on every backend).")
    if any(summary(rec)["messages_sent"] for rec in records):
        return "your function also sent point-to-point messages; one all_reduce is all it needs."
    return None


def check_all_mean(all_mean, exercise: str = "Exercise 0.2") -> None:
    """``all_mean(x)``: every rank's x becomes the element-wise mean over ranks, with one SUM all-reduce."""
    return check_collective(exercise, all_mean, _mean_of_everyone, rank_values, world_sizes=(2, 3, 4, 5),
                            sizes=(1, 6), dtypes=(torch.float32, torch.float64), traffic=_one_sum_all_reduce,
                            hint=("A mean is a sum divided by a count. Which reduction gives the sum, and which number "
                                  "is the count?"))
