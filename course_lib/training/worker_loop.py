"""The loop the data-parallel trainers of notebooks 08-11b share, and the loop their single-process references share.

As picotron wraps one model in its parallel wrappers around one training loop, each trainer hands `worker_steps`
only what is its own: which batch a worker takes, how it computes its gradient, and its algorithm after backward
(what it sends, how it updates the weights). Its callers: allreduce.dp_train, ps._worker and ps._colocated,
gossip.dpsgd_train, local_sgd.local_sgd_train, compression.compressed_train. `simulate_workers` is the loop of their
single-process references (gossip.simulate, local_sgd.simulate, compression.simulate_powersgd): one process playing
every worker. Two loops stay apart. overlap.overlap_train (notebook 09) has no meter to step and no loss to return:
its buckets cross as gloo all-reduces on an emulated NIC's thread, which the byte meter (point-to-point messages
only) never sees, and its gradient hooks stamp each bucket with the step it fills in. sharded_loop.train_steps
(notebook 12) opens a CommLog around each whole step, update included, and measures memory between the last backward
and the update: this loop has a place for neither.
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


def forward_backward(model, xb, yb, compute_s: float | None = None) -> float:
    """A worker's gradient on its whole batch (notebook 08): zeroed, then forward and backward in the timeline's
    "compute" lane, plus `compute_s` seconds of emulated compute when given; returns the loss."""
    q = next(model.parameters())
    model.zero_grad()
    with region("compute", "forward+backward"):
        loss = nn.functional.cross_entropy(model(xb.to(q.device, q.dtype)), yb.to(q.device))
        loss.backward()
        if compute_s is not None:
            emulated_link.compute(compute_s)
    return loss.item()


def worker_steps(steps: int, batch, forward_backward, update, meter, after_step=None) -> tuple[list, list]:
    """Train `steps` steps: `batch(step)` (this worker's x, y), `forward_backward(xb, yb)` (its loss), `update(step)`
    (the algorithm), the meter's step. Returns (losses, seconds per step: the emulated link's virtual clock inside
    emulate(link), else time.perf_counter). `after_step(step, seconds)`: a measurement, left out of the seconds."""
    losses, step_s = [], []
    for step in range(steps):
        t = emulated_link.now()
        losses.append(forward_backward(*batch(step)))
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
