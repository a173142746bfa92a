"""The training loop every sharded scheme shares: ZeRO stages 0-3 (zero.py) and FSDP2 (fsdp.py), notebook 12.

Each step: this rank's batch, forward, backward, the bytes the rank holds measured after the last backward, then the
scheme's own update; each step inside a CommLog, so the collectives of forward, backward and update are counted.
Not worker_loop.worker_steps: that loop has no place for a log around the whole step or for the memory measured
between backward and update.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from .. import device
from ..measure.comm_log import CommLog
from ..measure.memory import measure
from .data import load_digits, worker_batch


class NoLog:
    """Stands in for CommLog when traffic is not wanted: a dispatch mode runs Python for every tensor operation of
    the step, which a run that only wants losses and memory need not pay."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def summary(self) -> dict:
        return {}


def train_steps(model, params, steps, batch_size, seed, comm_log, update, grads, optimizer_state):
    """Run the loop: memory.measure after the last backward (`grads()`: what the rank holds as gradients then;
    `optimizer_state`: its tensors, or a function returning them, for an optimizer that makes its state at its first
    step), `update(t)` with t counting from 1; the batch is cast to the parameters' dtype (float32, or float64 for
    the exact comparison with single-process Adam). Returns (losses, CommLog summary per step, memory)."""
    rank, p, dev = dist.get_rank(), dist.get_world_size(), device()
    dtype = params[0].dtype
    x, y = load_digits()
    losses, traffic, memory = [], [], None
    for step in range(steps):
        xb, yb = worker_batch(x, y, rank, p, batch_size, step, seed)
        with (CommLog() if comm_log else NoLog()) as log:
            for q in params:
                q.grad = None
            loss = nn.functional.cross_entropy(model(xb.to(dev, dtype)), yb.to(dev))
            loss.backward()
            if step == steps - 1:
                state = optimizer_state() if callable(optimizer_state) else optimizer_state
                memory = measure(params, grads(), state)
            update(step + 1)
        losses.append(loss.item())
        traffic.append(log.summary())
    return losses, traffic, memory
