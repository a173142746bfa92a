"""Checkers for the exercises of notebooks/05b_collectives_cell_by_cell.ipynb, run on the live %ranks group.

The learner defines a function in a ``%%ranks`` cell; the check cell runs it on the same persistent ranks, on
several inputs, with every collective but the one the exercise is about switched off (switch_off.py) and its calls
counted (traffic.py), then pulls the results back and compares them with sums computed here.
"""

from __future__ import annotations

import torch

from ..results import RankFailed
from .c10d_names import everything_but
from .core import ExerciseFailed, not_attempted, passed, with_hint

_RESULT = "_course_check_result"


def _value(rank: int, case: int) -> torch.Tensor:
    """Rank r's input in case c: different per rank and element, negative values included."""
    return torch.tensor([float(rank + 1 + case), 10.0 * (rank + 1), -float(rank * (case + 2))])


def _sum(world: int, case: int) -> torch.Tensor:
    return sum(_value(r, case) for r in range(world))


# ------------------------------------------------------------------ on every rank
def on_rank(exercise: str, kind: str, fn, device, world: int) -> list:
    """Runs on each rank of the group: the learner's fn for every case, watched; returns [(result, record)]."""
    from .core import watched_call

    allowed = {"reduce_to": "reduce", "copy_from": "broadcast", "sum_by_gathering": "all_gather"}[kind]
    why = {"reduce": "Reduce, which delivers the sum to one rank",
           "broadcast": "Broadcast, one rank's tensor copied to every rank",
           "all_gather": "building a sum from one all_gather"}[allowed]
    import torch.distributed as dist

    rank, out = dist.get_rank(), []
    for case, peer in enumerate((0, world - 1, world // 2)):
        v = _value(rank, case).to(device)
        args = (v,) if kind == "sum_by_gathering" else (v, peer)
        got, record = watched_call(exercise, fn, args, forbid=everything_but(allowed), why=why)
        result = got if kind == "sum_by_gathering" else v     # reduce_to and copy_from work in place on v
        out.append((peer, result.detach().cpu() if isinstance(result, torch.Tensor) else result, record))
    return out


# ------------------------------------------------------------------ in the notebook's kernel
def _run_on_ranks(exercise: str, kind: str, fn_name: str, hint: str, ranks=None) -> list:
    from ..interactive import current

    ranks = ranks if ranks is not None else current()
    if ranks is None or not ranks.procs:
        raise ExerciseFailed(f"{exercise}: no ranks are running; start them with %ranks start 4 and run your "
                             f"%%ranks cell that defines {fn_name} first.")
    code = (f"import course_lib.checks.cell_by_cell as _course_check\n"
            f"{_RESULT} = _course_check.on_rank({exercise!r}, {kind!r}, {fn_name}, device, world_size)\n"
            f"del _course_check")
    try:
        ranks.run_cell(code, show=False)
    except RankFailed as exc:
        f = exc.failure
        if f.etype == "NotImplementedError":
            raise not_attempted(exercise, f.message) from None
        if f.etype == "NameError" and fn_name in f.message:
            raise ExerciseFailed(f"{exercise}: the ranks have no {fn_name}; run your %%ranks cell that defines it "
                                 "first.") from None
        if f.etype == "SwitchedOff":
            raise ExerciseFailed(with_hint(f"{f.message} (rank {f.rank})", hint)) from None
        raise ExerciseFailed(with_hint(f"{exercise}: your {fn_name} failed on rank {f.rank}: {f.etype}: "
                                       f"{f.message}", hint)) from None
    try:
        return ranks.pull(_RESULT)
    finally:
        ranks.run_cell(f"del {_RESULT}", show=False)


def _calls(exercise, per_rank, want: str, hint: str) -> None:
    for rank, cases in enumerate(per_rank):
        for _, _, record in cases:
            calls = [name for name, *_ in record["collectives"]]
            if calls != [want]:
                raise ExerciseFailed(with_hint(f"{exercise}: rank {rank} ran {calls or 'no collective'}; the "
                                               f"exercise needs exactly one {want}.", hint))


def check_reduce_to(ranks=None, exercise: str = "Exercise 5b.1") -> None:
    """``reduce_to(v, dst)`` on the live ranks (``ranks``: a persistent_ranks.Ranks; default: the %ranks group):
    afterwards rank dst's v holds the sum of every rank's v."""
    hint = ("Reduce (规约) is the collective that combines every rank's tensor into one rank's: every rank calls it, "
            "and "
            "only the destination is guaranteed to hold the sum afterwards. Look it up in torch.distributed.")
    per_rank = _run_on_ranks(exercise, "reduce_to", "reduce_to", hint, ranks)
    world = len(per_rank)
    _calls(exercise, per_rank, "reduce", hint)
    for case in range(3):
        dst = per_rank[0][case][0]
        got = per_rank[dst][case][1]
        if not torch.allclose(got, _sum(world, case)):
            raise ExerciseFailed(with_hint(f"{exercise}: with dst={dst}, rank {dst} holds {got.tolist()}, not the sum "
                                           "of every rank's v.", hint))
    return passed(exercise, f"rank dst held the sum for dst = 0, {world - 1} and {world // 2}, with one reduce each")


def check_copy_from(ranks=None, exercise: str = "Exercise 5b.2") -> None:
    """``copy_from(w, src)`` on the live ranks: afterwards every rank's w holds what rank src's w held."""
    hint = "Which collective leaves one rank's tensor on every rank? Which ranks must call it?"
    per_rank = _run_on_ranks(exercise, "copy_from", "copy_from", hint, ranks)
    _calls(exercise, per_rank, "broadcast", hint)
    for rank, cases in enumerate(per_rank):
        for case, (src, got, _) in enumerate(cases):
            if not torch.equal(got, _value(src, case)):
                raise ExerciseFailed(with_hint(f"{exercise}: with src={src}, rank {rank}'s w is {got.tolist()}, "
                                               f"rank {src}'s was {_value(src, case).tolist()}.", hint))
    return passed(exercise, "every rank held the source's w for three sources, with one broadcast each")


def check_sum_by_gathering(ranks=None, exercise: str = "Exercise 5b.3") -> None:
    """``sum_by_gathering(mine)`` on the live ranks: returns the sum of every rank's mine, from one all_gather."""
    hint = ("Gathering gives every rank every rank's tensor. What does it need to write them into, and what is left to "
            "do with them afterwards?")
    per_rank = _run_on_ranks(exercise, "sum_by_gathering", "sum_by_gathering", hint, ranks)
    world = len(per_rank)
    _calls(exercise, per_rank, "all_gather", hint)
    for rank, cases in enumerate(per_rank):
        for case, (_, got, _) in enumerate(cases):
            if not isinstance(got, torch.Tensor) or not torch.allclose(got, _sum(world, case)):
                raise ExerciseFailed(with_hint(f"{exercise}: rank {rank} returned {got!r}, not the sum of every "
                                               "rank's mine.", hint))
    return passed(exercise, "every rank returned the sum from one all_gather, with all-reduce switched off")
