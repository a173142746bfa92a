"""Checker of exercise 9.2 (notebooks/09_all_reduce_data_parallel.ipynb): section 3's Reducer made to survive a
parameter that gets no gradient (what DDP's find_unused_parameters is for).

The learner's reducer class trains a model whose middle layer some forwards skip, on real ranks: first ranks that
skip it on the same steps, then ranks that skip it on different steps. While it runs, torch's DDP, every collective
but all_reduce and the library's reducer are off, and every all-reduce is noted (its buffer, its size, whether
autograd's backward was running). Per rank and step the method must be DDP's: one all-reduce per bucket, buckets in
order, each launched during backward once its gradients and those before it are in, and every p.grad a view into
an all-reduced bucket; at the end, the weights of one process training on every rank's batches (tolerance from
course_lib.training.tolerance).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from ..measure.c10d_ops import everything_but
from ..measure.recorder import Recorder
from ..training import tolerance
from ..training.allreduce import buckets
from ..training.data import load_digits, worker_batch
from ..training.model import flat_params
from .core import ExerciseFailed, launch_checked, passed, with_hint
from .switch_off import SwitchedOff, _say, switched_off

BATCH = 16

# exercise 9.2: the reducer of section 3 on a model whose middle layer gets no gradient on some steps
CAP = 1024     # bytes: every Linear of _Branchy (bias and weight) closes a bucket of its own, last layer first
WHY_92 = "a reducer whose buckets survive a parameter without a gradient"


class _Branchy(nn.Module):
    """64 -> 32 -> 10 with a 32 -> 32 branch in between that a forward may skip (a branch not taken, an expert that
    got no tokens): then the branch's weight and bias get no gradient, and their hooks never fire."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.branch, self.last = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x, take: bool):
        h = torch.relu(self.first(x))
        if take:
            h = h + torch.relu(self.branch(h))
        return self.last(h)


def _takes(schedule: str, rank: int, step: int) -> bool:
    """"together": every rank skips the branch on odd steps; "apart": ranks skip it on different steps."""
    if schedule == "together":
        return step % 2 == 0
    return step % 3 == 0 or (rank + step) % 2 == 0


class _AllReduces(Recorder):
    """``with _AllReduces() as rec:`` notes every all-reduce (a view of measure/recorder.py's events): the storage it
    reduces, its elements, and whether autograd's backward was running (torch._C._current_graph_task_id() is -1
    outside it)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def recorded(self, seen, out, args) -> None:
        if seen.collective in ("all_reduce", "all_reduce_coalesced"):
            first = args[0][0] if isinstance(args[0], list) else args[0]
            self.calls.append((first.untyped_storage().data_ptr(), seen.numel,
                               torch._C._current_graph_task_id() != -1))


@contextmanager
def _no_ddp(exercise: str):
    """torch's DistributedDataParallel off: it is what the exercise builds."""
    from torch.nn.parallel import distributed

    real = distributed.DistributedDataParallel.__init__

    def refuse(*args, **kwargs):
        raise SwitchedOff(_say(exercise, WHY_92, "torch's DistributedDataParallel"))

    distributed.DistributedDataParallel.__init__ = refuse
    try:
        yield
    finally:
        distributed.DistributedDataParallel.__init__ = real


def _train_with_reducer(exercise, reducer_class, schedule, steps, lr):
    """On every rank: SGD on _Branchy with the learner's reducer; per step, its all-reduces and whether every
    p.grad is a view into a buffer that was all-reduced."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = load_digits()
    model = _Branchy().to(device())
    log = []
    with switched_off(exercise, everything_but("all_reduce"), WHY_92,
                      library=("course_lib.training.allreduce.BucketReducer.__init__",)), _no_ddp(exercise):
        reducer = reducer_class(model, CAP)
        for step in range(steps):
            xb, yb = worker_batch(x, y, rank, n, BATCH, step)
            take = _takes(schedule, rank, step)
            with _AllReduces() as rec:
                reducer.zero_grad()
                nn.functional.cross_entropy(model(xb.to(device()), take), yb.to(device())).backward()
                reducer.wait()
            reduced = {ptr for ptr, _, _ in rec.calls}
            views = {name: p.grad is not None and p.grad.untyped_storage().data_ptr() in reduced
                     for name, p in model.named_parameters()}
            log.append({"take": take, "calls": [(numel, inside) for _, numel, inside in rec.calls], "views": views})
            if not all(views.values()):
                break
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
    return flat_params(model).cpu(), log


def _branchy_single(world: int, schedule: str, steps: int, lr: float) -> torch.Tensor:
    """One process: every rank's batch and branch choice of each step, the mean of the ranks' mean losses."""
    x, y = load_digits()
    model = _Branchy()
    for step in range(steps):
        model.zero_grad()
        losses = []
        for r in range(world):
            xb, yb = worker_batch(x, y, r, world, BATCH, step)
            losses.append(nn.functional.cross_entropy(model(xb, _takes(schedule, r, step)), yb))
        (sum(losses) / world).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
    return flat_params(model)


def _step_problem(rank: int, step: int, entry: dict, want: list[int]) -> str | None:
    """What is wrong with one rank's step, in a sentence, or None."""
    where = f"rank {rank}, step {step} (this rank {'took' if entry['take'] else 'skipped'} the branch)"
    got = [numel for numel, _ in entry["calls"]]
    if got != want:
        if len(got) < len(want) and got == want[:len(got)]:
            return (f"{where}: only bucket(s) {list(range(len(got)))} were all-reduced; bucket(s) "
                    f"{list(range(len(got), len(want)))} never were, so their gradients stayed this rank's own.")
        if sorted(got) == sorted(want):
            return (f"{where}: the buckets ({want} elements, in bucket order) were all-reduced in the order {got}. "
                    "Every rank must start them in the same order, bucket 0 first, whichever parameters it used.")
        if len(got) > len(want):
            return (f"{where}: {len(got)} all-reduces of {got} elements; the {len(want)} buckets of this model hold "
                    f"{want} elements: one all-reduce per bucket.")
        return f"{where}: all-reduces of {got} elements; the buckets hold {want} elements, one all-reduce each."
    copied = [name for name, ok in entry["views"].items() if not ok]
    if copied:
        return (f"{where}: p.grad of {copied} is not a view into a bucket that was all-reduced (the gradients were "
                "copied, or set to None); keep every gradient a slice of its bucket's flat buffer, as the Reducer "
                "does.")
    late = [i for i, (_, inside) in enumerate(entry["calls"]) if not inside and (i == 0 or entry["take"])]
    if late:
        return (f"{where}: bucket(s) {late} were all-reduced after backward() returned, although all their "
                "gradients (and those of the buckets before them) were in during backward: launch them from the hooks, "
                "so that they overlap with the rest of backward.")
    return None


def check_reducer_with_unused_parameters(reducer_class, exercise: str = "Exercise 9.2") -> None:
    """`reducer_class(model, bucket_bytes)` with zero_grad() and wait(), as section 3's Reducer, trained on a model
    whose middle layer some steps skip: on 2 ranks that skip it together, then on 3 ranks that skip it on different
    steps. Per rank and step: one all-reduce per bucket in bucket order, each launched during backward when its
    gradients and those before it were in, every p.grad a view into an all-reduced bucket, and at the end the
    single-process weights. DDP, every other collective and the library's reducer are off while it runs."""
    hint = ("When a forward skips a layer, which hooks never fire, and what does that do to its bucket and to every "
            "bucket after it? What must each rank do before the step so that all ranks start the same all-reduces in "
            "the same order, whichever layers they used?")
    steps, lr = 4, 0.1
    for n, schedule in ((2, "together"), (3, "apart")):
        what = (f"{n} ranks that skip the branch {'on the same' if schedule == 'together' else 'on different'} "
                "steps")
        vals = launch_checked(exercise, _train_with_reducer, n, args=(exercise, reducer_class, schedule, steps, lr),
                              hint=hint, what=what)
        want = [sum(p.numel() for p in g) for g in buckets(list(_Branchy().parameters()), CAP)]
        for rank, (_, log) in enumerate(vals):
            for step, entry in enumerate(log):
                problem = _step_problem(rank, step, entry, want)
                if problem:
                    raise ExerciseFailed(with_hint(f"{exercise}: with {what}: {problem}", hint))
        ref = _branchy_single(n, schedule, steps, lr)
        # float32: each rank's mean, divided and summed across ranks, vs one process's mean of the ranks' means
        atol = tolerance.sgd_atol(steps, lr, n * BATCH, 64)
        bad = max(tolerance.max_diff(v, ref) for v, _ in vals)
        if bad > atol:
            raise ExerciseFailed(with_hint(f"{exercise}: with {what}, the weights differ from single-process SGD on "
                                           f"all ranks' batches by up to {bad:.3g} (float32 summation order allows "
                                           f"{atol:.1g}).", hint))
    return passed(exercise, "one all-reduce per bucket in bucket order, launched during backward, gradients as views, "
                            "and the single-process weights on 2 and 3 ranks that skip a layer together or apart")
