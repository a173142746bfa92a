"""Checkers for the exercises of notebooks/06_build_your_own_collectives.ipynb: the ring all-reduce and its bytes.

6.1 runs the learner's ring on world sizes 1-5, tensor sizes smaller than, equal to and not divisible by the world
size, integer and float dtypes, against torch's own dist.all_reduce (core.check_collective), with every
collective switched off, and checks the ring's method from the messages every rank sent: in place, only to the
right neighbour, 2(p-1) messages of at most ceil(n/p) elements, 2(p-1)/p·n bytes per rank in 2(p-1) rounds
(Patarasuk & Yuan 2009). A star, a tree or recursive doubling gives the right sum and fails here.
"""

from __future__ import annotations

import math

import torch

from .core import ExerciseFailed, check_collective, launch_checked, not_attempted, passed, with_hint
from .primitives import COURSE_COLLECTIVES, RING_ANSWERS
from .traffic import rounds, summary

RING_HINT = ("Read your traceback first: which rank, which step, which call. Then follow one chunk by hand on 3 ranks: "
             "after step s of the reduce-scatter, which partial sum does each rank hold, and which rank needs it next? "
             "Does every rank's send meet a posted receive, and does the result end up in t itself?")


def _make_input(rank: int, world: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Different values on every rank and element, so a chunk added twice or not at all shows."""
    base = torch.arange(size, dtype=torch.float64) * (world + 1) + rank * 10 + 1
    if dtype.is_floating_point:
        return (base / 7).to(dtype)
    return base.to(dtype)


def _torch_all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def ring_traffic(case, records) -> str | None:
    """None if every rank's messages are a ring all-reduce's, else what was measured and what a ring sends."""
    p, n = case.world, case.size
    el = torch.empty(0, dtype=case.dtype).element_size()
    stats = {rec["rank"]: summary(rec) for rec in records}
    measured = "; ".join(f"rank {r}: {s['bytes_sent']} B in {s['messages_sent']} messages to {s['sent_to']}"
                         for r, s in sorted(stats.items()))
    ring = (f"a ring sends each rank's 2(p-1)/p·n = {2 * (p - 1) * n * el / p:g} bytes in 2(p-1) = {2 * (p - 1)} "
            f"messages of at most ceil(n/p) = {math.ceil(n / p)} elements, only to its right neighbour, in "
            f"{2 * (p - 1)} rounds")
    if p == 1:
        return None if all(s["messages_sent"] == 0 for s in stats.values()) else (
            f"one rank has nobody to talk to, yet it sent messages ({measured}).")
    for r, s in stats.items():
        if s["sent_to"] not in ([], [(r + 1) % p]) or s["recv_from"] not in ([], [(r - 1) % p]):
            return (f"rank {r} sent to ranks {s['sent_to']} and received from {s['recv_from']}: {ring}. "
                    f"Measured: {measured}.")
        if s["largest_message"] > math.ceil(n / p) * el or s["messages_sent"] > 2 * (p - 1):
            return f"{ring}. Measured: {measured} (largest message {s['largest_message']} B on rank {r})."
    total = sum(s["bytes_sent"] for s in stats.values())
    if total != 2 * (p - 1) * n * el:
        return (f"all ranks together sent {total} bytes; in a ring every chunk crosses p-1 links in each phase, "
                f"2(p-1)·n = {2 * (p - 1) * n * el} bytes in all: {ring}. Measured: {measured}.")
    depth = rounds(records)
    if n >= p and n % p == 0 and depth != 2 * (p - 1):
        return f"the messages formed {depth} rounds (chains of a message waiting for the one before); {ring}."
    return None


def check_ring_all_reduce(learner, world_sizes=(1, 2, 3, 4, 5), sizes=(1, 4, 7, 12),
                          dtypes=(torch.float32, torch.int64), exercise: str = "Exercise 6.1") -> None:
    """`learner(tensor)` must leave the sum over ranks in `tensor` (in place), like dist.all_reduce, as a ring."""
    return check_collective(exercise, learner, _torch_all_reduce, _make_input, world_sizes=world_sizes, sizes=sizes,
                            dtypes=dtypes, hint=RING_HINT, forbid="all", why="building all_reduce from send/recv",
                            library=COURSE_COLLECTIVES, traffic=ring_traffic, in_place=True)


def _ring_bytes_sent(n):
    from course_lib.collectives import Traffic, ring_all_reduce
    from course_lib.devices import device

    traffic = Traffic()
    ring_all_reduce(torch.ones(n, device=device()), traffic=traffic)
    return traffic.bytes_sent


def check_ring_bytes_prediction(predicted_bytes_rank1, exercise: str = "Exercise 6.2") -> None:
    """`predicted_bytes_rank1()`: bytes rank 1 sends in the course's ring_all_reduce of 10 float32 on 4 ranks,
    predicted without running it (launching ranks is off); compared with the bytes counted on a real run."""
    from .switch_off import SwitchedOff, switched_off

    hint = ("Picture the ring's two phases on 4 ranks: in each step a rank passes one chunk to its neighbour. How many "
            "steps does each phase take, how big is a chunk of 10 values, and how many bytes is one float32?")
    try:
        with switched_off(exercise, why="predicting a ring's bytes before running it",
                          library=("course_lib.launch.run", *COURSE_COLLECTIVES, *RING_ANSWERS)):
            guess = predicted_bytes_rank1()
    except SwitchedOff as exc:
        raise ExerciseFailed(with_hint(str(exc), hint)) from None
    except NotImplementedError as exc:
        raise not_attempted(exercise, str(exc)) from None
    measured = launch_checked(exercise, _ring_bytes_sent, 4, args=(10,), hint=hint)[1]
    if guess != measured:
        raise ExerciseFailed(with_hint(f"{exercise}: you predicted {guess} bytes; rank 1 really sent {measured}.",
                                       hint))
    return passed(exercise, f"rank 1 sends {measured} bytes, as you predicted.")
