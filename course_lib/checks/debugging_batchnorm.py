"""Checker for notebook 18 (debugging distributed training), hunt 8: `global_batch_stats(h)`, the core of SyncBatchNorm,
used by BatchNorm in a data-parallel MLP on real ranks. The statistics must be those of every rank's samples, the
gradient must flow through them to every rank's samples (the weights equal single-process training on the combined
batch), and they must cross ranks as a few numbers per feature. Tolerances come from course_lib.training.tolerance.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from ..measure.c10d_ops import everything_but
from ..training import tolerance
from ..training.model import flat_params
from .core import ExerciseFailed, launch_checked, passed, watched_call, with_hint
from .debugging_data import BATCH, HIDDEN, LR, STEPS, _dev, _secret_batch
from .watch import summary


# ------------------------------------------------------------------------------------------- 18.8 BatchNorm
def batch_norm(h, stats, gamma, beta, eps=1e-5):
    """BatchNorm in training mode with the batch statistics `stats(h)` returns (mean, biased variance)."""
    mean, var = stats(h)
    return (h - mean) / torch.sqrt(var + eps) * gamma + beta


class BNNet(nn.Module):
    """64 -> HIDDEN, BatchNorm (statistics from a function), ReLU, -> 10."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, 10)
        w = self.fc1.weight      # new_ones: made inside torch, so the NCCL rules see a tensor of the rank's device
        self.gamma, self.beta = nn.Parameter(w.new_ones(hidden)), nn.Parameter(w.new_zeros(hidden))

    def forward(self, x, stats):
        return self.fc2(torch.relu(batch_norm(self.fc1(x), stats, self.gamma, self.beta)))


def _local_stats(h):
    return h.mean(0), h.var(0, unbiased=False)


def _bn_case(exercise, global_batch_stats, steps, lr):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = BNNet().to(device())
    records, stats_seen = [], []

    def stats(h):
        (mean, var), record = watched_call(exercise, global_batch_stats, (h,), forbid=everything_but("all_reduce"),
                                           why="batch statistics over every rank's samples",
                                           library=("torch.nn.modules.batchnorm.SyncBatchNorm.forward",))
        records.append(record)
        stats_seen.append((mean.detach().cpu(), var.detach().cpu()))
        return mean, var

    for step in range(steps):
        xb, yb = _dev(*_secret_batch(rank, step))
        model.zero_grad()
        nn.functional.cross_entropy(model(xb, stats), yb).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return flat_params(model).cpu(), stats_seen, [summary(r) for r in records]


def _bn_reference(world, steps, lr):
    model = BNNet()
    stats_seen = []
    for step in range(steps):
        parts = [_secret_batch(r, step) for r in range(world)]
        xb, yb = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        model.zero_grad()

        def stats(h):
            stats_seen.append(tuple(t.detach() for t in _local_stats(h)))
            return _local_stats(h)

        nn.functional.cross_entropy(model(xb, stats), yb).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return flat_params(model), stats_seen


def check_global_batch_stats(global_batch_stats, exercise: str = "Exercise 18.8") -> None:
    """`global_batch_stats(h)` -> (mean, biased variance) per feature over every rank's samples, differentiable:
    used by BatchNorm in a data-parallel MLP on 2 and 3 ranks, whose weights must equal single-process training on
    the combined batch; the statistics must travel as a few numbers per feature, not the whole batch."""
    hint = ("What must every rank know to compute the mean and variance of all ranks' samples, and how many numbers "
            "per feature is that? Does the gradient reach the other ranks' samples through those statistics?")
    for world in (2, 3):
        vals = launch_checked(exercise, _bn_case, world, args=(exercise, global_batch_stats, STEPS, LR), hint=hint,
                              what=f"{world} ranks", timeout=60)
        ref_w, ref_stats = _bn_reference(world, STEPS, LR)
        for rank, (weights, stats_seen, traffic) in enumerate(vals):
            # step 0 only: later statistics depend on the weights, which the gradient check below judges
            for step, ((mean, var), (rmean, rvar)) in enumerate(zip(stats_seen[:1], ref_stats[:1])):
                tol = tolerance.sum_atol(world * BATCH, world * BATCH * max(1.0, float(rmean.abs().max()) ** 2 + 1))
                bad = max(tolerance.max_diff(mean, rmean), tolerance.max_diff(var, rvar))
                if bad > tol:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks, step {step}: rank {rank}'s batch mean or variance differs from "
                        f"those of all {world * BATCH} samples by up to {bad:.3g} (float32 summation order allows "
                        f"{tol:.1g}).", hint))
            for step, t in enumerate(traffic):
                sent = sum(b for _, b, *_ in t["collective_calls"])
                if sent > 4 * HIDDEN * 4 or sent == 0:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks, step {step}: rank {rank}'s statistics called collectives of "
                        f"{sent} bytes in all, for {HIDDEN} features of {BATCH} samples each "
                        f"({BATCH * HIDDEN * 4} bytes of activations).", hint))
            atol = tolerance.sgd_atol(STEPS, LR, world * BATCH, HIDDEN)
            bad = tolerance.max_diff(weights, ref_w)
            if bad > atol:
                raise ExerciseFailed(with_hint(
                    f"{exercise}: {world} ranks: rank {rank}'s weights after {STEPS} steps differ from single-process "
                    f"training on the combined batch by up to {bad:.3g} (float32 summation order allows {atol:.1g}); "
                    "the forward statistics were right, so look at the gradient.", hint))
    return passed(exercise, "on 2 and 3 ranks the statistics are those of the combined batch, the weights equal "
                            "single-process training, and only a few numbers per feature crossed ranks")
