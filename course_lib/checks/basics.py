"""Checkers for the exercises of notebooks/00_start_here.ipynb: all-reduce with the right reduction, then ranks as data.

Each runs the learner's function on 2-5 real ranks against a reference built from torch's own collectives
(core.check_collective); the reference and the inputs live here, not in the notebook, so the check cell shows no
answer.
"""

from __future__ import annotations

import torch

from ..measure.c10d_ops import everything_but
from .core import check_collective
from .watch import summary

WORLDS = (2, 3, 4, 5)


def rank_values(rank: int, world_size: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Values that differ by rank and element, negative ones included, so MAX, SUM and a copy all differ."""
    return ((torch.arange(size) * (rank + 3)) % 7 - rank).to(dtype)


def tied_values(rank: int, world_size: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Four values only, so several ranks often share the largest one and the tie rule decides: with 7 elements the
    owner is rank 0 for some elements and a later rank for others, and the smallest tied rank differs from the
    largest one. Floats are fractional (-0.65 to 0.475), so a rule that holds only for whole numbers fails."""
    v = (torch.arange(size) * (rank + 2) + rank) % 4 - 2
    return (v * 0.375 + 0.1).to(dtype) if dtype.is_floating_point else v.to(dtype)


def _torch_max(x):
    import torch.distributed as dist

    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def _everyone(x):
    import torch.distributed as dist

    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)
    return torch.stack(everyone)


def _mean_of_everyone(x):
    """The mean computed another way than the exercise asks (gather everything, average in one process)."""
    return _everyone(x).mean(dim=0)


def _owner_of_everyone(x):
    """Gather everything; torch.argmax returns the first of equal maxima, i.e. the smallest rank (its documentation)."""
    return _everyone(x).argmax(dim=0)


def check_all_max(all_max, exercise: str = "Exercise 0.1", worlds=WORLDS) -> None:
    """``all_max(x)``: every rank's x becomes the element-wise maximum over ranks (in place), and is returned."""
    return check_collective(exercise, all_max, _torch_max, rank_values, world_sizes=worlds, sizes=(1, 5),
                            in_place=True,
                            hint=("Which reduction makes every rank end with the largest value? Look at the arguments "
                                  "dist.all_reduce takes."))


def _calls(rec) -> list:
    return [(name, op) for name, _, _, op, *_ in rec["collectives"]]


def _one_sum_all_reduce(case, records):
    for rec in records:
        calls = _calls(rec)
        if calls == [("all_reduce", None)]:
            # a route to all_reduce whose reduction the recorder cannot read (the functional one's string it can)
            return (f"rank {rec['rank']} reached all_reduce another way than dist.all_reduce, so the check cannot see "
                    "its reduction; call dist.all_reduce with a ReduceOp every backend has.")
        if calls == [("all_reduce", "SUM")] and rec["collectives"][0][4] > case.size:
            return (f"rank {rec['rank']} all-reduced {rec['collectives'][0][4]} elements, more than x's {case.size}: "
                    "every rank then holds a copy of everyone's data, which is a gather, not a mean of x.")
        if calls != [("all_reduce", "SUM")]:
            return (f"rank {rec['rank']} ran {calls or 'no collective'} (collective, reduction); the exercise asks "
                    "for one all_reduce with a reduction every backend has (ReduceOp.AVG is documented for NCCL "
                    "only), then arithmetic on every rank.")
    if any(summary(rec)["messages_sent"] for rec in records):
        return "your function also sent point-to-point messages; one all_reduce is all it needs."
    return None


def check_all_mean(all_mean, exercise: str = "Exercise 0.2", worlds=WORLDS) -> None:
    """``all_mean(x)``: every rank ends with the element-wise mean over ranks, from one SUM all-reduce."""
    return check_collective(exercise, all_mean, _mean_of_everyone, rank_values, world_sizes=worlds,
                            sizes=(1, 6), dtypes=(torch.float32, torch.float64), traffic=_one_sum_all_reduce,
                            hint=("A mean is a sum divided by a count. Which reduction gives the sum, and which number "
                                  "is the count?"))


# Two all-reduces of at most x's elements as int64: enough for the method, too little for a gather in disguise
# (an all-reduce of a world_size-row tensor) or one call per rank.
MAX_CALLS = 2
INT64_BYTES = 8


def _two_small_all_reduces(case, records):
    limit = case.size * INT64_BYTES
    for rec in records:
        calls = rec["collectives"]
        if len(calls) > MAX_CALLS:
            return (f"rank {rec['rank']} made {len(calls)} all_reduce calls with {case.world} ranks; the exercise "
                    f"allows {MAX_CALLS}, however many ranks there are.")
        wide = [numel for *_, numel in calls if numel > case.size]
        if wide:
            return (f"rank {rec['rank']} all-reduced {wide[0]} elements, more than x's {case.size}: every rank then "
                    "holds a copy of everyone's data, which is a gather, not what the exercise asks.")
        big = [nbytes for _, nbytes, *_ in calls if nbytes > limit]
        if big:
            return (f"rank {rec['rank']} all-reduced {big[0]} bytes, more than x's {case.size} elements as int64 "
                    f"({limit} bytes): every rank then holds a copy of everyone's data, which is a gather, not "
                    "what the exercise asks.")
    return None


def check_rank_of_max(rank_of_max, exercise: str = "Exercise 0.3", worlds=WORLDS) -> None:
    """``rank_of_max(x)``: every rank returns an int64 tensor shaped like x holding, per element, the smallest rank
    whose x holds the largest value; all_reduce only, at most two calls, each no larger than x as int64."""
    return check_collective(exercise, rank_of_max, _owner_of_everyone, tied_values, world_sizes=worlds,
                            sizes=(1, 7), dtypes=(torch.float32, torch.int64), forbid=everything_but("all_reduce"),
                            why="finding an owner with all_reduce alone", traffic=_two_small_all_reduces,
                            hint=("First let every rank learn the largest value. Then only the ranks that hold it "
                                  "should put forward their own rank, and a reduction can pick the smallest; what "
                                  "should the other ranks put forward so that they never win?"))
