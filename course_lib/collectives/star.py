"""Naive star all-reduce from send/recv: every rank sends its tensor to the root, the root reduces and sends back.

The baseline the tree and the ring improve on (Thakur et al., IJHPCA 2005); taught in
notebooks/06_build_your_own_collectives.ipynb. Two steps, but the root's link carries 2 (p-1) n bytes:
(p-1) n in and (p-1) n out, so its time grows linearly with p.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .p2p import Traffic, exchange, finish, flat_work, reducer
from .trace import Trace


def star_all_reduce(tensor: torch.Tensor, op="sum", root: int = 0, traffic: Traffic | None = None,
                    trace: Trace | None = None) -> torch.Tensor:
    """In-place all-reduce through one root; same result as dist.all_reduce for any world size >= 1."""
    rank, p = dist.get_rank(), dist.get_world_size()
    flat = flat_work(tensor)
    nbytes = flat.numel() * flat.element_size()
    if trace is not None:
        trace.begin("star", rank, p, [(0, flat.numel())], flat)
    others = [r for r in range(p) if r != root]
    if rank == root:
        combine, tmp = reducer(op), torch.empty_like(flat)
        for src in others:                         # in rank order, so the result does not depend on timing
            exchange(recv=tmp, src=src, traffic=traffic)
            combine(flat, tmp)
        sends_g = []
    else:
        exchange(send=flat, dst=root, traffic=traffic)
        sends_g = [(rank, root, 0, nbytes)]
    if trace is not None:
        trace.record("gather + reduce", sends_g, flat)
    if rank == root:
        reqs = [dist.isend(flat, dst) for dst in others] if flat.numel() else []
        for r in reqs:
            r.wait()
        if traffic is not None and flat.numel():
            traffic.bytes_sent += nbytes * len(others)
            traffic.messages_sent += len(others)
        sends_b = [(rank, dst, 0, nbytes) for dst in others]
    else:
        exchange(recv=flat, src=root, traffic=traffic)
        sends_b = []
    if trace is not None:
        trace.record("send back", sends_b, flat)
    return finish(tensor, flat)
