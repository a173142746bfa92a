"""Checkers for the exercises of notebooks/06_build_your_own_collectives.ipynb: the ring all-reduce and its bytes.

6.1 runs the learner's ring on world sizes 1-5, tensor sizes smaller than, equal to and not divisible by the world
size, integer and float dtypes, against torch's own dist.all_reduce (core.check_collective), with every
collective switched off, and checks the ring's method from the messages every rank sent: in place, only to the
right neighbour, 2(p-1) messages of at most ceil(n/p) elements, 2(p-1)·n bytes in all and between
2(p-1)·floor(n/p) and 2(p-1)·ceil(n/p) elements per rank, in 2(p-1) rounds when each step's send and receive are
posted together, at most 4(p-1) with blocking send/recv ordered so that it cannot deadlock (even ranks send
first: a receive must complete before the odd rank's send leaves). A star, a tree, recursive doubling or a ring
that lets one rank at a time pass (p rounds per step) gives the right sum and fails here.

6.2 asks for the bytes one rank sends in the course's ring_all_reduce for any (rank, p, n), predicted without
running anything: launching ranks (run, a persistent Ranks group), the course's collectives and every library
function that returns a ring's bytes are off while the learner's function runs.
"""

from __future__ import annotations

import math

import torch

from .core import ExerciseFailed, check_collective, launch_checked, not_attempted, passed, with_hint
from .primitives import COURSE_COLLECTIVES, RING_ANSWERS
from .watch import rounds, summary

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
    low, high = 2 * (p - 1) * (n // p) * el, 2 * (p - 1) * math.ceil(n / p) * el
    for r, s in stats.items():
        if s["sent_to"] not in ([], [(r + 1) % p]) or s["recv_from"] not in ([], [(r - 1) % p]):
            return (f"rank {r} sent to ranks {s['sent_to']} and received from {s['recv_from']}: {ring}. "
                    f"Measured: {measured}.")
        if s["largest_message"] > math.ceil(n / p) * el or s["messages_sent"] > 2 * (p - 1):
            return f"{ring}. Measured: {measured} (largest message {s['largest_message']} B on rank {r})."
        if not low <= s["bytes_sent"] <= high:
            return (f"rank {r} sent {s['bytes_sent']} bytes; in a ring every rank sends 2(p-1) chunks of "
                    f"floor(n/p) or ceil(n/p) elements, {low} to {high} bytes here: {ring}. Measured: {measured}.")
    total = sum(s["bytes_sent"] for s in stats.values())
    if total != 2 * (p - 1) * n * el:
        return (f"all ranks together sent {total} bytes; in a ring every chunk crosses p-1 links in each phase, "
                f"2(p-1)·n = {2 * (p - 1) * n * el} bytes in all: {ring}. Measured: {measured}.")
    depth = rounds(records)
    if n >= p and not 2 * (p - 1) <= depth <= 4 * (p - 1):
        return (f"the messages formed {depth} rounds (chains of a message waiting for the one before); {ring} (at "
                f"most {4 * (p - 1)} with blocking send/recv, where a step's receive must finish before some sends "
                "leave).")
    return None


def check_ring_all_reduce(learner, world_sizes=(1, 2, 3, 4, 5), sizes=(1, 4, 7, 12),
                          dtypes=(torch.float32, torch.int64), exercise: str = "Exercise 6.1") -> None:
    """`learner(tensor)` must leave the sum over ranks in `tensor` (in place), like dist.all_reduce, as a ring."""
    return check_collective(exercise, learner, _torch_all_reduce, _make_input, world_sizes=world_sizes, sizes=sizes,
                            dtypes=dtypes, hint=RING_HINT, forbid="all", why="building all_reduce from send/recv",
                            library=COURSE_COLLECTIVES, traffic=ring_traffic, in_place=True)


# Everything that runs or counts the ring for the learner: launching ranks in this process or on a persistent
# group, the course's ring and traffic counters, and every formula of a ring's bytes.
LAUNCHERS = ("course_lib.runtime.launch.run", "course_lib.runtime.persistent_ranks.Ranks.run_cell",
             "course_lib.runtime.persistent_ranks.Ranks.pull", "course_lib.runtime.persistent_ranks.Ranks.start")
RING_SHORTCUTS = (*LAUNCHERS, *COURSE_COLLECTIVES, *RING_ANSWERS,
                  "course_lib.measure.comm_log.Call.ring_bytes.fget", "course_lib.costs.alpha_beta.ring_reduce_scatter",
                  "course_lib.costs.alpha_beta.ring_all_gather", "course_lib.costs.alpha_beta.rabenseifner_allreduce")
BYTES_CASES = ((4, 10), (2, 5), (3, 7), (5, 3), (5, 12))    # (p, n): n not divisible by p, and n < p


def _ring_bytes_sent(sizes):
    from course_lib.collectives import Traffic, ring_all_reduce
    from course_lib.runtime.devices import device

    out = []
    for n in sizes:
        traffic = Traffic()
        ring_all_reduce(torch.ones(n, device=device()), traffic=traffic)
        out.append(traffic.bytes_sent)
    return out


def check_ring_bytes_prediction(predicted_bytes, exercise: str = "Exercise 6.2") -> None:
    """`predicted_bytes(rank, p, n)`: bytes `rank` sends in the course's ring_all_reduce of n float32 on p ranks,
    predicted without running anything (launching ranks and the library's ring and formulas are off); compared
    with the bytes counted on real runs, for every rank of several (p, n), n not divisible by p and n < p."""
    from .switch_off import SwitchedOff, switched_off

    hint = ("Which chunk does rank r send at each step of the reference ring's two phases, and which chunk does it "
            "never send in each? How big is each chunk when torch.tensor_split cuts n values into p pieces?")
    guesses = {}
    try:
        with switched_off(exercise, why="predicting a ring's bytes before running it", library=RING_SHORTCUTS):
            for p, n in BYTES_CASES:
                for rank in range(p):
                    guesses[p, n, rank] = predicted_bytes(rank, p, n)
    except SwitchedOff as exc:
        raise ExerciseFailed(with_hint(str(exc), hint)) from None
    except NotImplementedError as exc:
        raise not_attempted(exercise, str(exc)) from None
    for p in sorted({p for p, _ in BYTES_CASES}):
        sizes = [n for q, n in BYTES_CASES if q == p]
        measured = launch_checked(exercise, _ring_bytes_sent, p, args=(sizes,), hint=hint)
        for i, n in enumerate(sizes):
            for rank in range(p):
                if guesses[p, n, rank] != measured[rank][i]:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {n} float32 on {p} ranks: you predicted {guesses[p, n, rank]} bytes for rank "
                        f"{rank}; it really sent {measured[rank][i]}.", hint))
    return passed(exercise, "every rank's bytes, as you predicted, for "
                  + ", ".join(f"n={n} on p={p}" for p, n in BYTES_CASES))
