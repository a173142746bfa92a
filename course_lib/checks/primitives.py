"""Checkers for the exercises of notebooks 03-05: groups, point-to-point and collectives, run on real ranks.

Each checker runs the learner's function next to torch's own op (core.check_collective) for world sizes 2-5,
several sizes and dtypes, and prints a pass line or raises ExerciseFailed naming the case, the rank, what was
expected and what came back.
"""

from __future__ import annotations

from functools import partial

import torch

from ..launch import run
from ..results import RankFailed
from .core import ExerciseFailed, _fmt, check_collective

WORLDS = (2, 3, 4, 5)


def _distinct(rank, world, size, dtype):
    """Every rank's input differs from every other's, so a value that lands on the wrong rank is visible."""
    return (torch.arange(size) + 100 * rank + 1).to(dtype)


def _call(fn, t, **kwargs):
    return fn(t, **kwargs)


def _checked(exercise, hint, **kw):
    """check_collective with this module's hint (a deadlock ends at the timeout and fails the check)."""
    return check_collective(exercise, hint=hint, **kw)


# ---------------------------------------------------------------- broadcast from send/recv (notebook 04)
def _from_last(fn, t):
    import torch.distributed as dist

    return fn(t, src=dist.get_world_size() - 1)


def _torch_broadcast(t, src):
    import torch.distributed as dist

    dist.broadcast(t, src=src)
    return t


def check_broadcast(my_broadcast, exercise: str = "Exercise 4.2 (broadcast from send/recv)", worlds=WORLDS):
    """``my_broadcast(t, src)`` must leave src's tensor in ``t`` on every rank and return ``t`` (src: last rank)."""
    return _checked(
        exercise,
        "the source (src) sends its tensor to every other rank; every other rank receives into t from src. "
        "Use the src argument (the check uses the last rank, not 0), and return t on every rank.",
        learner=partial(_from_last, my_broadcast), reference=partial(_from_last, _torch_broadcast),
        make_input=_distinct, world_sizes=worlds, timeout=10,
    )


# ---------------------------------------------------------------- all-gather from send/recv (notebook 04)
def _torch_all_gather(t):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def check_all_gather(my_all_gather, exercise: str = "Exercise 4.3 (all-gather from send/recv)", worlds=WORLDS):
    """``my_all_gather(t)`` must return a list whose entry j is rank j's tensor on every rank (as dist.all_gather)."""
    return _checked(
        exercise,
        "return a list with one tensor per rank, in rank order, your own tensor included at your own index. "
        "If it hangs, two ranks are both waiting in recv (or both in send): order the calls, or use isend/irecv.",
        learner=partial(_call, my_all_gather), reference=_torch_all_gather, make_input=_distinct,
        world_sizes=worlds, timeout=10,
    )


# ---------------------------------------------------------------- ring exchange without deadlock (notebook 04)
def _torch_from_left(t):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return _torch_all_gather(t)[(rank - 1) % world]


def check_ring_exchange(ring_exchange, exercise: str = "Exercise 4.1 (fix the deadlock)", worlds=WORLDS):
    """``ring_exchange(t)`` sends t to rank+1 and returns what came from rank-1; it must finish (5 s per case)."""
    return _checked(
        exercise,
        "a blocking send on gloo waits until the peer posts the matching recv. If every rank sends first, every rank "
        "waits. Let even ranks send first and odd ranks receive first, or start both with isend/irecv and wait.",
        learner=partial(_call, ring_exchange), reference=_torch_from_left, make_input=_distinct,
        world_sizes=worlds, sizes=(1, 7, 50_000), timeout=5,
    )


# ---------------------------------------------------------------- all-reduce inside the odd ranks (notebook 03)
def _torch_odd_all_reduce(t):
    import torch.distributed as dist

    odd = dist.new_group(list(range(1, dist.get_world_size(), 2)))
    if dist.get_rank() % 2 == 1:
        dist.all_reduce(t, group=odd)
    return t


def check_odd_group_all_reduce(odd_all_reduce, exercise: str = "Exercise 3.1 (all-reduce among the odd ranks)",
                               worlds=WORLDS):
    """``odd_all_reduce(t)`` sums t over the odd ranks only (even ranks keep theirs) and returns t, on every rank."""
    return _checked(
        exercise,
        "every rank must call dist.new_group(...) with the same list of odd ranks, even the ranks not in it; "
        "only the members then call dist.all_reduce(t, group=...). Even ranks return their tensor unchanged.",
        # The launcher keeps every rank alive until all are done (a final barrier), so ranks outside the new
        # group cannot exit while its members are still connecting it.
        learner=partial(_call, odd_all_reduce), reference=_torch_odd_all_reduce,
        make_input=_distinct,
        world_sizes=worlds, timeout=10,
    )


# ---------------------------------------------------------------- all-reduce = reduce-scatter + all-gather (05)
def _torch_all_reduce(t):
    import torch.distributed as dist

    dist.all_reduce(t)
    return t


def check_all_reduce(my_all_reduce, exercise: str = "Exercise 5.2 (all-reduce from reduce-scatter + all-gather)",
                     worlds=WORLDS):
    """``my_all_reduce(t)`` must return the sum of every rank's t, for sizes that do not divide by the world size."""
    return _checked(
        exercise,
        "reduce_scatter_single and all_gather_single need a length divisible by the world size: pad t with zeros "
        "to the next multiple, and cut the padding off the result.",
        learner=partial(_call, my_all_reduce), reference=_torch_all_reduce, make_input=_distinct,
        world_sizes=worlds, sizes=(1, 7, 12), timeout=10,
    )


# ---------------------------------------------------------------- predict a reduce-scatter (notebook 05)
def _real_reduce_scatter(inputs):
    import torch.distributed as dist

    x = torch.tensor(inputs[dist.get_rank()])
    out = torch.empty(len(x) // dist.get_world_size(), dtype=x.dtype)
    dist.reduce_scatter_single(out, x)
    return out.tolist()


def check_reduce_scatter_prediction(inputs, predicted,
                                    exercise: str = "Exercise 5.1 (predict a reduce-scatter)") -> str:
    """Run reduce_scatter_single (SUM) on len(inputs) ranks with those inputs and compare with the learner's guess."""
    world = len(inputs)
    if len(predicted) != world:
        raise ExerciseFailed(f"{exercise}: you predicted {len(predicted)} ranks' results, but {world} ranks take part.")
    try:
        real = run(_real_reduce_scatter, world, args=([list(x) for x in inputs],), output="none", timeout=10).values
    except RankFailed as exc:
        raise ExerciseFailed(f"{exercise}: the real run failed (are all inputs the same length, a multiple of "
                             f"{world}?)\n\n{exc}") from None
    for rank, (want, got) in enumerate(zip(real, predicted)):
        if [float(v) for v in want] != [float(v) for v in got]:
            raise ExerciseFailed(
                f"{exercise}: rank {rank} really holds {_fmt(torch.tensor(want))}, you predicted {list(got)}.\n"
                f"Hint: rank {rank} receives the sum over all ranks of chunk {rank} (elements "
                f"{rank * len(want)}..{(rank + 1) * len(want) - 1} of each input); it never sees the other chunks."
            )
    line = f"✓ {exercise} passed: your prediction matches a real reduce_scatter_single on {world} ranks."
    print(line)
    return line
