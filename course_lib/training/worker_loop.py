"""The loop the data-parallel trainers of notebooks 08-11b share, and the loop their single-process references share.

As picotron wraps one model in its parallel wrappers around one training loop, each trainer hands `worker_steps`
only what is its own: which batch a worker takes, how it computes its gradient, and its algorithm after backward
(what it sends, how it updates the weights). Its callers: allreduce.dp_train, ps._worker and ps._colocated,
gossip.dpsgd_train, local_sgd.local_sgd_train, compression.compressed_train. `simulate_workers` is the loop of their
single-process references (gossip.simulate, local_sgd.simulate, compression.simulate_powersgd): one process playing
every worker. Two loops stay apart. overlap.overlap_train (notebook 09) draws forward, backward, the wait for the
buckets in flight and the SGD step as four regions timed against its emulated NIC thread's clock, so its loop stays
written out in that order rather than hidden in callables. sharded_loop.train_steps (notebook 12) records one CommLog
around each whole step (FSDP's all-gathers in forward, the reduce-scatters in backward, the update), which this loop
has no place for.
"""

from __future__ import annotations

import torch
from torch import nn

from ..measure import emulated_link
from ..measure.timeline import region
from .data import worker_batch


def sgd_(params, lr: float, grads=None) -> None:
    """Plain SGD in place, w <- w - lr g (g: each parameter's .grad unless `grads` is given), by hand: torch.optim's
    first step costs seconds in every freshly started rank process."""
    params = list(params)
    with torch.no_grad():
        for q, g in zip(params, [q.grad for q in params] if grads is None else grads):
            q -= lr * g


def loss_backward(model, xb, yb, compute_s: float | None = None, scale: int = 1) -> float:
    """Forward and backward of one batch in the timeline's "compute" lane, the loss divided by `scale` (a
    micro-batch's share of its batch), plus `compute_s` seconds of emulated compute when given; the gradients add to
    what .grad holds (notebook 09's accumulation). Returns the loss."""
    q = next(model.parameters())
    with region("compute", "forward+backward"):
        loss = nn.functional.cross_entropy(model(xb.to(q.device, q.dtype)), yb.to(q.device)) / scale
        loss.backward()
        if compute_s is not None:
            emulated_link.compute(compute_s)
    return loss.item()


def forward_backward(model, xb, yb, compute_s: float | None = None) -> float:
    """A worker's gradient on its whole batch (notebook 08): zeroed, then loss_backward; returns the loss."""
    model.zero_grad()
    return loss_backward(model, xb, yb, compute_s)


def worker_steps(steps: int, batch, grad_step, update, meter, after_step=None) -> tuple[list, list]:
    """Train `steps` steps: `batch(step)` (this worker's x, y), `grad_step(xb, yb)` (its gradient; returns the loss),
    `update(step)` (the algorithm), the meter's step. Returns (losses, seconds per step: the emulated link's virtual
    clock inside emulate(link), else time.perf_counter). `after_step(step, seconds)`: a measurement, left out of the
    seconds."""
    losses, step_s = [], []
    for step in range(steps):
        t = emulated_link.now()
        losses.append(grad_step(*batch(step)))
        update(step)
        meter.step()
        step_s.append(emulated_link.now() - t)
        if after_step is not None:
            after_step(step, step_s[-1])
    return losses, step_s


def simulate_workers(model_of, n_workers: int, steps: int, batch_size: int, seed: int, data, after_backward,
                     after_step) -> None:
    """One process playing n workers in turn, every step: each worker's backward on its batch of its shard with
    `model_of(w)` (its own model, or one model loaded with its weights), `after_backward(step, w, model)` after each,
    `after_step(step)` once all have (the average, the gossip round, the compressed sum)."""
    x, y = data
    for step in range(steps):
        for w in range(n_workers):
            model = model_of(w)
            xb, yb = worker_batch(x, y, w, n_workers, batch_size, step, seed)
            model.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            after_backward(step, w, model)
        after_step(step)
