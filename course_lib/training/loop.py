"""The one training loop the data-parallel trainers of notebooks 08-11b share, and the one their references share.

As picotron wraps one model in its parallel wrappers around one training loop, each trainer hands `worker_steps` only
its algorithm: what it does after backward (what it sends, how it updates the weights). One step of a worker: its batch
of its own shard (data.worker_batch), the gradients zeroed, forward and backward in a "compute" region (with a fixed
emulated compute cost on the link's virtual clock when asked), the algorithm, then the byte meter's step and the step's
seconds. Its callers: allreduce.dp_train, ps._worker and ps._colocated, gossip.dpsgd_train, local_sgd.local_sgd_train,
compression.compressed_train. `simulate_workers` is the loop of their single-process references (gossip.simulate,
local_sgd.simulate, compression.simulate_powersgd): one process playing every worker.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
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


def worker_steps(model, steps: int, batch_size: int, seed: int, update, meter, data, *, worker: int | None = None,
                 workers: int | None = None, by_label: bool = False, compute_s: float | None = None, zero_grad=None,
                 accum: int = 1, micro_batch=None, after_step=None) -> tuple[list[float], list[float]]:
    """Train `steps` steps as worker `worker` of `workers` (default: this rank of the world) on `data` (x, y);
    return (loss per step, seconds per step on the link's virtual clock). `update(step)` is the algorithm, after
    backward; `after_step(step, seconds)` runs once the step is timed (a measurement, left out of its seconds).
    accum > 1: the batch in that many micro-batches, each entered with `micro_batch(last)` (DDP's no_sync) and its
    loss divided by accum; `zero_grad` in place of the model's (a bucket reducer keeps its gradient buffers)."""
    worker = dist.get_rank() if worker is None else worker
    workers = dist.get_world_size() if workers is None else workers
    x, y = data
    q = next(model.parameters())
    losses, step_s = [], []
    for step in range(steps):
        t = emulated_link.now()
        xb, yb = worker_batch(x, y, worker, workers, batch_size, step, seed, by_label)
        (zero_grad or model.zero_grad)()
        total = 0.0
        for j, (xm, ym) in enumerate(zip(xb.chunk(accum), yb.chunk(accum))):
            last = j == accum - 1
            with micro_batch(last) if micro_batch else contextlib.nullcontext(), region("compute", "forward+backward"):
                loss = nn.functional.cross_entropy(model(xm.to(q.device, q.dtype)), ym.to(q.device)) / accum
                loss.backward()
                if compute_s is not None and last:
                    emulated_link.compute(compute_s)
            total += loss.item()
        update(step)
        meter.step()
        losses.append(total)
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
