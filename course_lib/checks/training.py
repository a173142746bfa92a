"""Checkers for the exercises of notebooks 09-10 (all-reduce data parallel, PS vs all-reduce); notebook 08's
parameter server is checked in parameter_server.py, exercise 9.2's reducer in reducer.py.

Each runs the learner's function on real ranks (or against real measured traffic) and compares with a reference
computed here: single-process SGD on the combined batch (with ranks' batches of different sizes), dist.all_reduce,
the bytes counted on every message. While the learner's code runs, the collectives and library functions that would
answer the exercise for them are switched off (switch_off.py) and its messages are counted (watch.py). Tolerances
come from course_lib.training.tolerance (float32 summation order, derived there).
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist
from torch import nn

from ..costs import alpha_beta
from ..runtime.devices import device
from ..training import tolerance
from ..training.allreduce import dp_train
from ..training.data import load_digits, shard_indices
from ..training.model import flat_params, make_mlp
from .algorithms import RING_SHORTCUTS
from .core import ExerciseFailed, call_learner, launch_checked, passed, watched_call, with_hint

STEPS, BATCH, HIDDEN = 3, 16, 32
PS_ANSWERS = ("course_lib.measure.traffic.expected", "course_lib.costs.alpha_beta.ps_vs_allreduce")


# ---------------------------------------------------------------- notebook 09
def _sizes(world: int) -> list[int]:
    """Batch sizes that differ by rank (an epoch's last batches rarely split evenly)."""
    return [BATCH - 4 * r for r in range(world)]


def _uneven_batch(x, y, rank, world, step):
    idx = shard_indices(len(x), rank, world)
    b = _sizes(world)[rank]
    pos = torch.arange(step * b, (step + 1) * b) % len(idx)
    return x[idx[pos]], y[idx[pos]]


def _dp_with_learner(exercise, average_gradients, steps, lr):
    rank, n, dev = dist.get_rank(), dist.get_world_size(), device()
    x, y = load_digits()
    model = make_mlp(HIDDEN, 0).to(dev)          # on the rank's GPU under NCCL: its gradients are what NCCL moves
    for step in range(steps):
        xb, yb = _uneven_batch(x, y, rank, n, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(xb.to(dev)), yb.to(dev)).backward()   # the mean over this rank's own batch
        watched_call(exercise, average_gradients, (model, len(yb)))
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return flat_params(model).cpu()


def _uneven_single(world: int, steps: int, lr: float) -> torch.Tensor:
    """One process, every rank's batch of each step at once, the mean loss over all those samples."""
    x, y = load_digits()
    model = make_mlp(HIDDEN, 0)
    for step in range(steps):
        parts = [_uneven_batch(x, y, r, world, step) for r in range(world)]
        model.zero_grad()
        xb, yb = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        nn.functional.cross_entropy(model(xb), yb).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return flat_params(model)


def check_average_gradients(average_gradients, exercise: str = "Exercise 9.1") -> None:
    """`average_gradients(model, batch_size)`: after backward of this rank's mean loss over its `batch_size`
    samples, make every p.grad the gradient of the mean loss over ALL ranks' samples (batches differ in size).
    Trained on 2 and 3 real ranks; every rank must end with the single-process weights."""
    hint = ("A rank's gradient is a mean over its own samples, and the batches differ in size. What is the global mean "
            "over every sample in terms of the ranks' means and batch sizes?")
    lr = 0.1
    for n in (2, 3):
        vals = launch_checked(exercise, _dp_with_learner, n, args=(exercise, average_gradients, STEPS, lr), hint=hint,
                              what=f"{n} ranks with batches of {_sizes(n)} samples")
        ref = _uneven_single(n, STEPS, lr)
        atol = tolerance.sgd_atol(STEPS, lr, sum(_sizes(n)), HIDDEN)
        bad = max(tolerance.max_diff(v, ref) for v in vals)
        if bad > atol:
            plain = launch_checked(exercise, _dp_with_learner, n, args=(exercise, _plain_mean, STEPS, lr))
            same = max(tolerance.max_diff(v, w) for v, w in zip(vals, plain)) <= atol
            extra = (" Your gradients equal the plain mean of the ranks' gradients, which counts a sample of a small "
                     "batch more than one of a big batch." if same else "")
            raise ExerciseFailed(with_hint(f"{exercise}: with {n} ranks holding {_sizes(n)} samples, the weights "
                                           f"differ from single-process SGD on all {sum(_sizes(n))} samples by up to "
                                           f"{bad:.3g} (float32 summation order allows {atol:.1g}).{extra}", hint))
    return passed(exercise, "every rank ends with the single-process weights for 2 and 3 ranks with batches of "
                            "different sizes")


def _plain_mean(model, batch_size):
    """The demo's average, ignoring batch sizes: what a learner's first attempt usually does."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


# ---------------------------------------------------------------- notebook 10
def _ring_bytes_case():
    out = dp_train(steps=1, batch_size=8, hidden=60, method="bucket", collective="ring", bucket_bytes=1 << 30)
    return out["traffic"][0][0], out["model_bytes"]


def check_ring_bytes(ring_bytes, exercise: str = "Exercise 10.1") -> None:
    """`ring_bytes(n, model_bytes)` -> bytes each rank sends per ring all-reduce; checked against real ring runs
    (every message counted) on 2-4 ranks within one element per phase (the chunks differ by at most one element),
    and for 5-64 ranks against 2(n-1)/n M, which that rule gives. Launching ranks, the course's ring and every
    library formula of a ring's bytes are off while the learner's code runs."""
    hint = ("A ring all-reduce has two phases. How many steps does each take, and what fraction of the model does a "
            "rank send in one step?")
    m = flat_params(make_mlp(60, 0)).numel() * 4         # the model _ring_bytes_case trains
    answers = {n: call_learner(exercise, ring_bytes, n, m, hint=hint, why="the bytes of a ring",
                               library=RING_SHORTCUTS) for n in (2, 3, 4, 5, 8, 64)}
    for n, ans in answers.items():
        if isinstance(ans, torch.Tensor) and ans.numel() == 1:
            ans = ans.item()                             # a 0-d tensor of bytes is a number too
        if not isinstance(ans, numbers.Real) or isinstance(ans, bool):
            raise ExerciseFailed(with_hint(f"{exercise}: n={n}: you returned {ans!r}, not a number of bytes.", hint))
        if n > 4:      # beyond what this machine runs: the bytes a ring of n ranks sends, to the same 8 bytes
            if abs(ans - 2 * (n - 1) * m / n) > 8:
                raise ExerciseFailed(with_hint(f"{exercise}: n={n}, M={m}: you said {ans:.0f}, which is not what a "
                                               f"ring of {n} ranks sends.", hint))
            continue
        vals = launch_checked(exercise, _ring_bytes_case, n)
        assert vals[0][1] == m, "the ring trained another model"
        worst = max(abs(ans - sent) for sent, _ in vals)
        if worst > 8:
            raise ExerciseFailed(with_hint(f"{exercise}: n={n}, M={m}: you said {ans:.0f}, ranks really sent "
                                           f"{[s for s, _ in vals]} bytes.", hint))
    return passed(exercise, "matches the bytes counted on real ring runs for 2-4 ranks, and a ring's for 5-64")


BYTEPS_ANSWERS = (*PS_ANSWERS, "course_lib.costs.alpha_beta.byteps_optimal")


def check_servers_to_match_ring(cpu_machines_needed, exercise: str = "Exercise 10.2") -> None:
    """`cpu_machines_needed(n, ratio)` -> the smallest k in 0..n for which BytePS's time with k CPU machines,
    2n(n-1)M/((n^2+kn-2k)B) (Jiang et al. OSDI'20, Theorem 1), is at most `ratio` x ring all-reduce's
    2(n-1)M/(nB), or None when even k = n is not enough; compared for n = 2..64 and several ratios."""
    hint = ("Write BytePS's time divided by the ring's: what is left of it, and how does it fall as k grows? Which k "
            "first brings it to the ratio, and what can k = n reach at best?")
    for n in range(2, 65):
        for ratio in (1.0, 0.9, 0.75, 0.6, 0.5):
            ring = 2 * (n - 1) / n
            want = next((k for k in range(n + 1)
                         if alpha_beta.byteps_optimal(n, 1.0, 1.0, k) <= ratio * ring * (1 + 1e-12)), None)
            got = call_learner(exercise, cpu_machines_needed, n, ratio, hint=hint,
                               why="solving BytePS's formula for k", library=BYTEPS_ANSWERS)
            if got != want:
                raise ExerciseFailed(with_hint(f"{exercise}: n={n} GPU machines, at most {ratio:g} x the ring's time: "
                                               f"you said {got!r}, which is not the smallest k.", hint))
    return passed(exercise, "right for every n from 2 to 64 and ratios from 1 to 0.5")
