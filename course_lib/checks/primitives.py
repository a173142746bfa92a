"""Checkers for the exercises of notebooks 04-05: point-to-point and collectives, run on real ranks (03: groups.py).

Each runs the learner's function next to torch's own op (core.check_collective) for world sizes 2-5, several sizes
and dtypes, with the collectives the exercise asks them to build switched off, and checks the method from the
traffic every rank really sent (watch.py): who talked to whom, how many bytes, which collective on which group.
"""

from __future__ import annotations

import re
from functools import partial

import torch

from ..measure.c10d_ops import everything_but
from ..runtime.devices import device
from ..runtime.results import RankFailed
from .blocking_only import blocking_call
from .core import ExerciseFailed, _fmt, check_collective, not_attempted, passed, with_hint
from .watch import summary

WORLDS = (2, 3, 4, 5)
# The course's own collectives answer these exercises: off while the learner's function runs.
# Every function of the course's own collectives, the private halves too (ring._all_gather is a whole all-gather).
COURSE_COLLECTIVES = tuple(f"course_lib.collectives.{m}" for m in (
    "ring.ring_all_reduce", "ring.ring_reduce_scatter", "ring.ring_all_gather", "ring._reduce_scatter",
    "ring._all_gather", "tree.tree_all_reduce", "tree._reduce",
    "tree._broadcast", "recursive_doubling.recursive_doubling_all_reduce", "star.star_all_reduce",
    "rabenseifner.rabenseifner_all_reduce", "rabenseifner._halving", "rabenseifner._doubling",
    "hierarchical.hierarchical_all_reduce"))
# Every library function that returns a ring all-reduce's bytes (exercises 6.2 and 10.1 ask for them).
RING_ANSWERS = ("course_lib.measure.traffic.expected", "course_lib.costs.alpha_beta.allreduce_traffic",
                "course_lib.costs.alpha_beta.ring_allreduce", "course_lib.training.compression.ring_sent_bytes",
                "course_lib.training.zero.ring_bytes_formula", "course_lib.costs.decentralized.sent_per_step",
                # with bandwidth 1 these return a ring's bytes too
                "course_lib.costs.alpha_beta.ps_vs_allreduce", "course_lib.costs.alpha_beta.byteps_optimal",
                "course_lib.costs.alpha_beta.hierarchical_allreduce", "course_lib.costs.projection.ring_step",
                "course_lib.costs.projection.project", "course_lib.costs.parallel_plan.ring_all_reduce_s",
                "course_lib.costs.alpha_beta.tree_over_ring_ratio", "course_lib.training.overlap.link_for",
                "course_lib.costs.alpha_beta.star_allreduce",
                *(f"course_lib.bench.collectives.FACTORS.{op}" for op in ("all_reduce", "reduce_scatter",
                                                                       "all_gather", "alltoall")))


def _distinct(rank, world, size, dtype):
    """Every rank's input differs from every other's, so a value that lands on the wrong rank is visible."""
    return (torch.arange(size) + 100 * rank + 1).to(dtype)


def _call(fn, t, **kwargs):
    return fn(t, **kwargs)


def _nbytes(case) -> int:
    return case.size * torch.empty(0, dtype=case.dtype).element_size()


# ---------------------------------------------------------------- ring exchange without deadlock (notebook 04)
# Exercise 4.1 asks for an order of blocking calls: the calls that post a message without waiting are off.
NON_BLOCKING = tuple(f"torch.distributed.distributed_c10d.{name}" for name in (
    "isend", "irecv", "batch_isend_irecv"))


def _torch_from_left(t):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return _torch_all_gather(t)[(rank - 1) % world]


def _one_message_right(case, records):
    n, p = _nbytes(case), case.world
    for rec in records:
        r, s = rec["rank"], summary(rec)
        want = {"messages_sent": 1, "bytes_sent": n, "sent_to": [(r + 1) % p], "recv_from": [(r - 1) % p]}
        got = {k: s[k] for k in want}
        if got != want:
            return (f"rank {r} sent {s['messages_sent']} message(s), {s['bytes_sent']} bytes, to {s['sent_to']} and "
                    f"received from {s['recv_from']}; a ring shift sends its tensor ({n} bytes) once to rank "
                    f"{(r + 1) % p} and receives once from rank {(r - 1) % p}.")
    return None


def check_ring_exchange(ring_exchange, exercise: str = "Exercise 4.1", worlds=WORLDS, timeout: float = 10):
    """``ring_exchange(t)`` sends t to rank+1 and returns what came from rank-1; it must finish (``timeout`` s per
    world size: a deadlock ends there)."""
    return check_collective(
        exercise, partial(blocking_call, exercise, ring_exchange), _torch_from_left, _distinct, world_sizes=worlds,
        sizes=(1, 7, 50_000), timeout=timeout, forbid="all", why="ordering send and recv so a ring cannot deadlock",
        library=("course_lib.collectives.p2p.exchange", *NON_BLOCKING), traffic=_one_message_right,
        hint=("If it hung, read your traceback: which call was each rank waiting in? A blocking send on gloo waits "
              "until its peer posts the matching recv. What happens when every rank does the same thing first? If "
              "a value is wrong: rank r must end with rank r-1's tensor; who sends to rank 0?"))


# ---------------------------------------------------------------- broadcast from send/recv (notebook 04)
# One launch per world size runs every case, so each tensor size gets its own src: the last rank, a middle one
# and 0. Two or more of them differ on every world size, which a broadcast that ignores src, or that only reaches
# the ranks below it (range(src)) or above it, cannot pass.
BROADCAST_SIZES = (1, 7, 12)


def _src(world: int, size: int) -> int:
    return {1: world - 1, 7: world // 2, 12: 0}[size]


def _with_src(fn, t):
    import torch.distributed as dist

    return fn(t, src=_src(dist.get_world_size(), t.numel()))


def _torch_broadcast(t, src):
    import torch.distributed as dist

    dist.broadcast(t, src=src)
    return t


def _each_receives_once(case, records):
    n, src = _nbytes(case), _src(case.world, case.size)
    for rec in records:
        r, s = rec["rank"], summary(rec)
        want = 0 if r == src else n
        if s["bytes_recv"] != want:
            return (f"rank {r} received {s['bytes_recv']} bytes in {s['messages_recv']} message(s); in a broadcast "
                    f"from rank {src} every other rank receives the tensor ({n} bytes) exactly once and the source "
                    "receives nothing.")
    return None


_CASE = re.compile(r"with world_size=(\d+), size=(\d+), dtype=\w+")


def check_broadcast(my_broadcast, exercise: str = "Exercise 4.2", worlds=WORLDS):
    """``my_broadcast(t, src)`` must leave src's tensor in ``t`` on every rank and return ``t``, for src = the last
    rank, a middle rank and 0 (one per tensor size, named in a failure)."""
    try:
        return check_collective(
            exercise, partial(_with_src, my_broadcast), partial(_with_src, _torch_broadcast), _distinct,
            world_sizes=worlds, sizes=BROADCAST_SIZES, timeout=10, forbid="all",
            why="building broadcast from send/recv", library=COURSE_COLLECTIVES, traffic=_each_receives_once,
            in_place=True, hint=("Which rank has the data, and which ranks need it? The check tries several src "
                                 "values, 0 and others. What does each rank hold, and return, afterwards?"))
    except ExerciseFailed as exc:     # a case's text has no src: name the one it used
        raise ExerciseFailed(_CASE.sub(lambda m: f"{m.group(0)}, src={_src(int(m.group(1)), int(m.group(2)))}",
                                       str(exc))) from None


# ---------------------------------------------------------------- all-gather from send/recv (notebook 04)
def _torch_all_gather(t):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _receives_every_other(case, records):
    n, p = _nbytes(case), case.world
    for rec in records:
        r, s = rec["rank"], summary(rec)
        if s["bytes_recv"] != (p - 1) * n:
            return (f"rank {r} received {s['bytes_recv']} bytes in {s['messages_recv']} message(s); in an "
                    f"all-gather every rank receives each of the other {p - 1} tensors once, "
                    f"{p - 1} x {n} = {(p - 1) * n} bytes.")
    return None


def check_all_gather(my_all_gather, exercise: str = "Exercise 4.3", worlds=WORLDS):
    """``my_all_gather(t)`` must return a list whose entry j is rank j's tensor on every rank (as dist.all_gather)."""
    return check_collective(
        exercise, partial(_call, my_all_gather), _torch_all_gather, _distinct, world_sizes=worlds, timeout=10,
        forbid="all", why="building all-gather from send/recv", library=COURSE_COLLECTIVES,
        traffic=_receives_every_other,
        hint=("What must the list hold on every rank, and at which index is your own tensor? If it hangs, read your "
              "traceback: which call is each rank waiting in?"))


# ---------------------------------------------------------------- all-reduce = reduce-scatter + all-gather (05)
def _torch_all_reduce(t):
    import torch.distributed as dist

    dist.all_reduce(t)
    return t


def _one_rs_one_ag(case, records):
    p, item = case.world, torch.empty(0, dtype=case.dtype).element_size()
    length = -(-case.size // p) * p * item     # the fewest bytes >= the tensor's that split into p equal chunks
    for rec in records:
        r, calls = rec["rank"], {name: size for name, size, *_ in rec["collectives"]}
        if sorted(name for name, *_ in rec["collectives"]) != ["all_gather_single", "reduce_scatter_single"]:
            return (f"rank {r} ran {sorted(calls) or 'no collective'}; all-reduce = one reduce_scatter_single "
                    "followed by one all_gather_single.")
        if calls["reduce_scatter_single"] != length or calls["all_gather_single"] != length:
            return (f"rank {r}'s reduce_scatter_single took {calls['reduce_scatter_single']} bytes in and its "
                    f"all_gather_single gave {calls['all_gather_single']} bytes out; your tensor is {case.size} "
                    f"element(s) of {item} bytes, and each rank's share of an all-reduce passes once through each "
                    f"collective, so both move {length} bytes: the tensor, with only as many extra elements as "
                    f"{p} equal chunks need.")
    return None


def check_all_reduce(my_all_reduce, exercise: str = "Exercise 5.2", worlds=WORLDS):
    """``my_all_reduce(t)`` must return the sum of every rank's t, for sizes that do not divide by the world size,
    with one reduce_scatter_single and one all_gather_single (everything else switched off)."""
    return check_collective(
        exercise, partial(_call, my_all_reduce), _torch_all_reduce, _distinct, world_sizes=worlds,
        sizes=(1, 7, 12), timeout=10, why="building all-reduce from reduce-scatter and all-gather",
        forbid=everything_but("reduce_scatter_single", "all_gather_single"),
        library=COURSE_COLLECTIVES, traffic=_one_rs_one_ag,
        hint=("What do reduce_scatter_single and all_gather_single require of a tensor's length, and what does the "
              "check's size 7 do on 2 or 4 ranks?"))


# ---------------------------------------------------------------- predict a reduce-scatter (notebook 05)
def _real_reduce_scatter(inputs):
    import torch.distributed as dist

    x = torch.tensor(inputs[dist.get_rank()], device=device())      # NCCL moves only tensors on the rank's GPU
    out = torch.empty(len(x) // dist.get_world_size(), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, x)
    return out.tolist()


def check_reduce_scatter_prediction(inputs, predicted, exercise: str = "Exercise 5.1") -> None:
    """``predicted()`` returns what each rank's output holds after reduce_scatter_single (SUM) with ``inputs``;
    compared with a real run on len(inputs) ranks. It is a prediction: launching ranks and collectives are off."""
    from ..runtime.launch import run
    from .switch_off import SwitchedOff, switched_off

    hint = ("Which chunk of each input does rank j receive in a reduce-scatter, and what happens to it? Write the "
            "lists by hand: the check runs the real collective afterwards.")
    if callable(predicted):
        try:
            # the notebook's process has no process group: launching ranks is the only way to run it
            with switched_off(exercise, why="predicting a reduce-scatter before running it",
                              library=("course_lib.runtime.launch.run",)):
                predicted = predicted()
        except SwitchedOff as exc:
            raise ExerciseFailed(with_hint(str(exc), hint)) from None
        except NotImplementedError as exc:
            raise not_attempted(exercise, str(exc)) from None
    world = len(inputs)
    if not isinstance(predicted, (list, tuple)) or len(predicted) != world:
        raise ExerciseFailed(f"{exercise}: you predicted {predicted!r}; give one list per rank, {world} ranks take "
                             "part.")
    try:
        real = run(_real_reduce_scatter, world, args=([list(x) for x in inputs],), output="none", timeout=10).values
    except RankFailed as exc:
        raise ExerciseFailed(f"{exercise}: the real run failed (are all inputs the same length, a multiple of "
                             f"{world}?)\n\n{exc}") from None
    for rank, (want, got) in enumerate(zip(real, predicted)):
        if [float(v) for v in want] != [float(v) for v in got]:
            raise ExerciseFailed(with_hint(
                f"{exercise}: rank {rank} really holds {_fmt(torch.tensor(want))}, you predicted {list(got)}.",
                f"Which part of each input ends up on rank {rank}, and combined how?"))
    return passed(exercise, f"your prediction matches a real reduce_scatter_single on {world} ranks.")
