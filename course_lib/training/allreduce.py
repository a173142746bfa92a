"""All-reduce data parallel (数据并行) three ways: every gradient on its own, flattened buckets, torch DDP.

Taught in notebooks/09_all_reduce_data_parallel.ipynb. Every rank is a worker with the same initial weights
(same seed) and its own data shard; after backward the gradients are averaged with all-reduce, so every replica
takes the same SGD step as one process on the combined batch. "naive": one all-reduce per parameter tensor;
"bucket": BucketReducer, the reducer the notebook builds in a cell (gradients as views into flat buckets filled
last layer first, as DDP fills them; one all-reduce per bucket, launched from gradient hooks during backward when
overlap=True); "ddp": torch.nn.parallel.DistributedDataParallel (Li et al., VLDB 2020), with no_sync() for
gradient accumulation. collective="ring" uses the course's ring from point-to-point messages (notebook 06) instead
of dist.all_reduce, so that traffic.metered counts its bytes and emulated_link.emulate delays them: the fair comparison
with the PS.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from ..collectives import ring_all_reduce
from ..measure.emulated_link import emulate
from ..measure.timeline import Timeline, region
from ..measure.traffic import Meter, metered
from .data import load_digits, worker_batch
from .model import flat_params, make_mlp
from .worker_loop import loss_backward, sgd_, worker_steps


def _all_reduce(collective: str):
    if collective == "torch":
        return dist.all_reduce
    if collective == "ring":
        return ring_all_reduce
    raise ValueError(f"collective must be 'torch' or 'ring', got {collective!r}")


def buckets(params: list, bucket_bytes: int, first_bucket_bytes: int | None = None) -> list[list]:
    """DDP's bucket assignment (torch/csrc/distributed/c10d/reducer.cpp, compute_bucket_assignment_by_size, called
    with the gradients' ready order): parameters last layer first, one dtype and device per bucket, and a bucket
    closes once it holds at least its cap (first_bucket_bytes for the first one, bucket_bytes after)."""
    out, open_ = [], {}                     # (dtype, device) -> [params, bytes, buckets closed so far]
    for p in reversed(params):              # backward produces the last layer's gradients first
        cur = open_.setdefault((p.dtype, p.device), [[], 0, 0])
        cur[0].append(p)
        cur[1] += p.numel() * p.element_size()
        cap = first_bucket_bytes if first_bucket_bytes is not None and cur[2] == 0 else bucket_bytes
        if cur[1] >= cap:
            out.append(cur[0])
            open_[(p.dtype, p.device)] = [[], 0, cur[2] + 1]
    return out + [cur[0] for cur in open_.values() if cur[0]]


class BucketReducer:
    """The reducer notebook 09 builds in a cell, after DDP's (torch/csrc/distributed/c10d/reducer.cpp): every
    gradient is a view into its bucket's flat buffer; a hook on every parameter counts the gradients in; a full
    bucket is divided by the world size and all-reduced with async_op while backward goes on, buckets strictly in
    order; wait() before the step. overlap=False reduces the buckets one after another after backward instead
    (with any in-place all-reduce, the course's ring included)."""

    def __init__(self, model: nn.Module, bucket_bytes: int, all_reduce=dist.all_reduce, overlap: bool = True):
        if overlap and all_reduce is not dist.all_reduce:
            raise ValueError("overlap needs an asynchronous all-reduce: use collective='torch'")
        self.n, self.all_reduce, self.overlap, self.works = dist.get_world_size(), all_reduce, overlap, []
        self.groups = buckets(list(model.parameters()), bucket_bytes)
        self.flats = []
        for i, group in enumerate(self.groups):
            flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device)
            off = 0
            for p in group:
                p.grad = flat[off:off + p.numel()].view_as(p)     # autograd accumulates into the bucket itself
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._grad_ready(i))
                off += p.numel()
            self.flats.append(flat)
        self.zero_grad()

    def zero_grad(self):
        """Zero the buckets (model.zero_grad() would set the views to None)."""
        for flat in self.flats:
            flat.zero_()
        self.arm(True)

    def arm(self, armed: bool = True):
        """Before each backward: only an armed one launches all-reduces; the others (micro-batches under
        accumulation) just add into the same views."""
        self.armed, self.pending, self.next = armed, [len(g) for g in self.groups], 0

    def _grad_ready(self, i: int):
        self.pending[i] -= 1
        while self.overlap and self.armed and self.next < len(self.groups) and self.pending[self.next] == 0:
            self._launch(self.next)

    def _launch(self, i: int):
        flat = self.flats[i]
        with region("comm", f"bucket {i} launch" if self.overlap else f"all-reduce bucket {i}"):
            flat /= self.n                   # DDP divides by the world size, then sums
            if self.overlap:
                self.works.append(dist.all_reduce(flat, async_op=True))
            else:
                self.all_reduce(flat)
        self.next = i + 1

    def wait(self):
        """Before the optimizer step: every bucket averaged."""
        if not self.overlap:
            for i in range(len(self.groups)):
                self._launch(i)
            return
        with region("wait", "buckets in flight"):
            for work in self.works:
                work.wait()
        self.works = []


def dp_train(steps: int = 10, batch_size: int = 32, lr: float = 0.1, hidden: int = 256, seed: int = 0,
             method: str = "naive", collective: str = "torch", bucket_bytes: int = 1 << 20, overlap: bool = False,
             accum: int = 1, link=None, profile: bool = False, compute_s: float | None = None) -> dict:
    """Run on every rank: data-parallel SGD where each of the world's ranks trains on its own shard.

    accum > 1 splits each rank's batch into `accum` micro-batches and all-reduces once per step (DDP: no_sync on
    all but the last). Returns final flat parameters, per-step losses, seconds and bytes (sent, received; only the
    course ring's messages are counted), and timeline events. `link`: an emulated link that the course ring's
    messages cross, timed on its virtual clock; `compute_s`: a fixed emulated cost added to each step's backward.
    """
    if method not in ("naive", "bucket", "ddp"):
        raise ValueError(f"method must be 'naive', 'bucket' or 'ddp', got {method!r}")
    if batch_size % accum:
        raise ValueError(f"batch_size {batch_size} must split into accum={accum} equal micro-batches")
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = device()
    model = make_mlp(hidden, seed).to(dev)
    all_reduce = _all_reduce(collective)
    reducer = None
    if method == "ddp":
        if collective != "torch":
            raise ValueError("DDP all-reduces inside torch's process group: use collective='torch'")
        model = nn.parallel.DistributedDataParallel(model, device_ids=[dev] if dev.type == "cuda" else None,
                                                    bucket_cap_mb=bucket_bytes / 2**20)
    elif method == "bucket":
        reducer = BucketReducer(model, bucket_bytes, all_reduce, overlap)

    def accumulate(xb, yb):
        """The batch in `accum` micro-batches whose gradients add up, each loss divided by accum, so that the sum is
        the whole batch's gradient; only the last backward all-reduces (DDP: no_sync() on the others)."""
        (reducer or model).zero_grad()            # a reducer zeroes its buckets: model.zero_grad() drops the views
        loss = 0.0
        for j, (xm, ym) in enumerate(zip(xb.chunk(accum), yb.chunk(accum))):
            last = j == accum - 1
            if reducer:
                reducer.arm(last)
            with model.no_sync() if method == "ddp" and not last else contextlib.nullcontext():
                loss += loss_backward(model, xm, ym, compute_s if last else None, scale=accum)
        return loss

    def average_and_step(step: int):
        if method == "naive":
            for p in model.parameters():
                with region("comm", "all-reduce grad"):
                    all_reduce(p.grad)
                    p.grad /= n
        elif reducer:
            reducer.wait()
        with region("compute", "sgd step"):
            sgd_(model.parameters(), lr)

    (x, y), meter, tl = load_digits(), Meter(), Timeline(profile)
    with emulate(link), metered(meter), tl:
        losses, step_s = worker_steps(steps, lambda step: worker_batch(x, y, rank, n, batch_size, step, seed),
                                      accumulate, average_and_step, meter)
    inner = model.module if method == "ddp" else model
    flat = flat_params(inner)
    return {"params": flat.cpu(), "losses": losses, "step_s": step_s, "traffic": meter.steps,
            "timeline": tl.events, "model_bytes": flat.numel() * flat.element_size()}
