"""Gradient all-reduce overlapped with backward when communication has a resource of its own (notebook 09).

On a GPU, NCCL runs each collective as a kernel on its own CUDA stream, on a few of the GPU's SMs, and the bytes
cross NVLink or the NIC: backward keeps computing while a bucket travels. On a CPU-only laptop, gloo's all-reduce
needs the same cores as backward, so overlapping them mostly makes them compete. Here every rank gets an emulated
NIC instead: a thread that all-reduces each bucket (a real gloo all_reduce, so the sums are real) and then sleeps
until the link model's ring time for it has passed (alpha_beta.ring_allreduce with the link's alpha and beta).
A sleeping thread holds no core, so backward keeps its own: the situation of a GPU with its own link, not of ranks
fighting over two cores. Buckets fill from gradient hooks, last layer first, as in DDP (Li et al., VLDB 2020).
"""

from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from ..costs import alpha_beta
from ..measure.emulated_link import Link
from ..measure.emulated_link import link as named_link
from .allreduce import buckets
from .data import combined_batch, load_digits, worker_batch
from .model import flat_params


def deep_mlp(depth: int = 6, width: int = 512, seed: int = 0) -> nn.Sequential:
    """64 -> width -> ... -> width -> 10 with ReLU, `depth` Linear layers: layers of equal size, so that each
    layer's gradient is one bucket and backward has work left to hide every bucket but the last behind."""
    torch.manual_seed(seed)
    sizes = [64] + [width] * (depth - 1) + [10]
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < depth - 1 else [])
    return nn.Sequential(*layers)


def reference(steps: int = 4, n: int = 2, depth: int = 6, width: int = 512, batch_size: int = 256, lr: float = 0.05,
              seed: int = 0) -> torch.Tensor:
    """One process, plain SGD on the combined batch of n workers per step: the weights overlap_train must end with."""
    x, y = load_digits()
    model = deep_mlp(depth, width, seed)
    for step in range(steps):
        xb, yb = combined_batch(x, y, n, batch_size, step, seed)
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return flat_params(model)


class EmulatedNIC:
    """This rank's link: runs bucket all-reduces one at a time, each held for the link model's time. submit() hands
    a bucket to the NIC's own thread (overlap); transfer() runs one in the caller's thread (no overlap)."""

    def __init__(self, link: Link, t0: float):
        self.link, self.t0, self.events = link, t0, []
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def model_s(self, flat: torch.Tensor) -> float:
        """Seconds the link model gives a ring all-reduce of this bucket: 2(p-1) alpha + 2(p-1)/p n beta."""
        n = flat.numel() * flat.element_size()
        return alpha_beta.ring_allreduce(dist.get_world_size(), n, self.link.alpha, self.link.beta)

    def transfer(self, name: str, flat: torch.Tensor) -> None:
        start = time.perf_counter()
        dist.all_reduce(flat)                      # the real sum (a few ms of this machine's CPU)
        left = start + self.model_s(flat) - time.perf_counter()
        if left > 0:
            time.sleep(left)                       # the rest of the wire time: no core is held
        self.events.append(("comm", name, start - self.t0, time.perf_counter() - self.t0))

    def submit(self, name: str, flat: torch.Tensor) -> None:
        self._jobs.put((name, flat))

    def drain(self) -> None:
        """Return once every submitted bucket has been all-reduced."""
        self._jobs.join()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self.transfer(*job)
            finally:
                self._jobs.task_done()


def overlap_train(steps: int = 4, link: Link | str = "1 GbE", overlap: bool = True, depth: int = 6,
                  width: int = 512, batch_size: int = 256, lr: float = 0.05, seed: int = 0,
                  threads: int = 1, bucket_bytes: int | None = None, layer_s: float | None = None) -> dict:
    """Run on every rank: data-parallel SGD on deep_mlp with its gradients as views into flat buckets (notebook 09's
    Reducer), all-reduced through this rank's EmulatedNIC, launched from gradient hooks during backward (overlap)
    or after it. bucket_bytes: DDP's bucket cap (allreduce.buckets); None: one bucket per layer's weight and bias.
    layer_s: each layer's backward charged a fixed emulated time on top of its real arithmetic (a sleep in a backward
    hook, which holds no core), so that the schedule is the same on any machine; None: real compute only.

    threads: intra-op threads for compute (1: each rank keeps one core). Returns final flat parameters, seconds
    per step, the bucket sizes, timeline events (lane, name, start_s, end_s) with t = 0 after a common barrier,
    and when each bucket was complete (launched: (step, bucket, t)).
    """
    torch.set_num_threads(threads)
    lnk = named_link(link) if isinstance(link, str) else link
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = device()
    model = deep_mlp(depth, width, seed).to(dev)
    # last layer first, the order backward finishes them: one bucket per layer (its weight and bias), or DDP's caps
    groups = ([list(m.parameters()) for m in reversed(model) if isinstance(m, nn.Linear)] if bucket_bytes is None
              else buckets(list(model.parameters()), bucket_bytes))
    flats = []
    for group in groups:                           # every gradient a view into its bucket's flat buffer
        flat = torch.zeros(sum(p.numel() for p in group), device=dev)
        off = 0
        for p in group:
            p.grad = flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        flats.append(flat)
    if layer_s is not None:
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.register_full_backward_pre_hook(lambda *_: time.sleep(layer_s))
    x, y = load_digits()
    state = {"ready": [0] * len(groups)}
    launched = []   # (step, bucket, seconds since t0) when its last gradient arrived

    def ready(i: int) -> None:
        state["ready"][i] += 1
        if state["ready"][i] == len(groups[i]):    # the bucket's last gradient is in: send it now
            launched.append((len(step_s), i, time.perf_counter() - t0))
            if overlap:
                nic.submit(f"bucket {i}", flats[i])

    for i, group in enumerate(groups):
        for p in group:
            p.register_post_accumulate_grad_hook(lambda _p, i=i: ready(i))

    dist.barrier()
    t0 = time.perf_counter()
    nic, events, step_s = EmulatedNIC(lnk, t0), [], []

    def region(lane, name, fn):
        s = time.perf_counter()
        out = fn()
        events.append((lane, name, s - t0, time.perf_counter() - t0))
        return out

    try:
        for step in range(steps):
            start = time.perf_counter()
            xb, yb = worker_batch(x, y, rank, n, batch_size, step, seed)
            state["ready"] = [0] * len(groups)
            for flat in flats:                         # zero the buckets: model.zero_grad() would drop the views
                flat.zero_()
            loss = region("compute", "forward",
                          lambda: nn.functional.cross_entropy(model(xb.to(dev)), yb.to(dev)))  # noqa: B023
            region("compute", "backward", loss.backward)
            if overlap:
                region("wait", "buckets in flight", nic.drain)
            else:
                for i in range(len(groups)):
                    nic.transfer(f"bucket {i}", flats[i])

            def update():
                with torch.no_grad():
                    for p in model.parameters():
                        p -= lr * p.grad / n           # the bucket holds the sum over ranks

            region("compute", "sgd step", update)
            step_s.append(time.perf_counter() - start)
    finally:
        nic.close()
    return {"params": flat_params(model).cpu(), "step_s": step_s, "launched": launched,
            "timeline": sorted(events + nic.events, key=lambda e: e[2]),
            "bucket_bytes": [sum(p.numel() * p.element_size() for p in g) for g in groups]}


def link_for(layer_s: float, width: int = 512, alpha: float = 100e-6, p: int | None = None) -> Link:
    """A link on which the bucket of one width x width layer (weight and bias) takes layer_s seconds to all-reduce
    over p ranks (alpha_beta.ring_allreduce): communication as long as that layer's backward."""
    p = dist.get_world_size() if p is None else p
    layer_bytes = (width * width + width) * 4
    bandwidth = 2 * (p - 1) / p * layer_bytes / max(layer_s - 2 * (p - 1) * alpha, 1e-4)
    return Link(f"emulated link, {bandwidth / 1e6:.0f} MB/s", alpha, bandwidth)


def balanced_link(depth: int = 6, width: int = 512, batch_size: int = 256, alpha: float = 100e-6,
                  seed: int = 0) -> Link:
    """link_for the time one layer's backward takes on this machine (measured on every rank, slowest wins): the
    case where overlap can hide the most. Call on every rank, with one compute thread."""
    x, y = load_digits()
    model = deep_mlp(depth, width, seed).to(device())
    times = []
    for step in range(3):                      # the first backward pays one-time costs: keep the fastest
        xb, yb = worker_batch(x, y, dist.get_rank(), dist.get_world_size(), batch_size, step, seed)
        loss = nn.functional.cross_entropy(model(xb.to(device())), yb.to(device()))
        start = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([min(times)], device=device())
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return link_for(float(slowest) / depth, width, alpha)


def overlap_compare(steps: int = 5, link: Link | str | None = None, **kwargs) -> dict:
    """Run on every rank: overlap_train with buckets after backward, then during it, over the same link (None:
    link_for(layer_s) when layer_s is given, else balanced_link()). Returns {"link": Link, "after": overlap_train's
    result, "during": ...}."""
    torch.set_num_threads(kwargs.get("threads", 1))
    shape = {k: kwargs[k] for k in ("depth", "width", "batch_size", "seed") if k in kwargs}
    if link is None and kwargs.get("layer_s") is not None:
        link = link_for(kwargs["layer_s"], kwargs.get("width", 512))
    lnk = link if link is not None else balanced_link(**shape)
    return {"link": lnk, "after": overlap_train(steps, lnk, overlap=False, **kwargs),
            "during": overlap_train(steps, lnk, overlap=True, **kwargs)}
