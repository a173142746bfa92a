"""A straggler (掉队者) on purpose: one rank whose forward and backward take `factor` times as long (notebook 11b).

Hooks on the model time each step's compute, from the forward call to the last gradient of backward. Inside
emulated_link.emulate(link) every rank's compute costs a fixed compute_s on the virtual clock (the straggler's factor *
compute_s): a stand-in for a GPU step of known length, the same on any machine. Outside it, with compute_s = 0 the
chosen rank sleeps (factor - 1) times its measured compute, and with compute_s > 0 every rank's compute is padded by
sleeping to compute_s (the straggler's to factor * compute_s); sleeping, not spinning, so the ranks sharing this
machine's cores keep their speed. Every rank records its compute seconds per step: step time - compute time = time
spent waiting for others.
"""

from __future__ import annotations

import time

import torch.distributed as dist
from torch import nn

from ..measure import emulated_link


class Straggler:
    """Attach to a model on every rank; only `rank` is slowed (rank -1 or factor 1: nobody)."""

    def __init__(self, model: nn.Module, rank: int = -1, factor: float = 1.0, compute_s: float = 0.0):
        if factor < 1 or compute_s < 0:
            raise ValueError(f"a straggler is slower, not faster: need factor >= 1 and compute_s >= 0, got "
                             f"factor={factor}, compute_s={compute_s}")
        slow = dist.get_rank() == rank
        self.factor = factor if slow else 1.0
        self.floor = compute_s * self.factor
        self.compute_s: list[float] = []
        self._params = [q for q in model.parameters() if q.requires_grad]
        self._t0, self._left = None, 0
        model.register_forward_pre_hook(self._start)
        for q in self._params:
            q.register_post_accumulate_grad_hook(self._grad_done)

    def _start(self, module, args):
        if self._t0 is None:          # several forwards before one backward count from the first
            self._t0, self._left = time.perf_counter(), len(self._params)

    def _grad_done(self, param):
        self._left -= 1
        if self._left == 0 and self._t0 is not None and emulated_link.virtual():
            emulated_link.compute(self.floor)
            self.compute_s.append(self.floor)
            self._t0 = None
        elif self._left == 0 and self._t0 is not None:
            work = time.perf_counter() - self._t0
            extra = self.floor - work if self.floor else (self.factor - 1) * work
            if extra > 0:
                time.sleep(extra)
            self.compute_s.append(time.perf_counter() - self._t0)
            self._t0 = None
