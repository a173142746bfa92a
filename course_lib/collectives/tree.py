"""All-reduce as a binomial-tree reduce then a binomial-tree broadcast, from isend/irecv.

Thakur, Rabenseifner & Gropp, IJHPCA 2005 (sections 4.1, 4.4); taught in notebooks/06_build_your_own_collectives.ipynb.
lg p rounds each way (lg = ceil(log2 p)); in round k, ranks whose distance from the root has lowest set bit 2^k
send the whole tensor to the rank 2^k below them. Every rank sends the whole tensor once in the reduce; in the
broadcast the root sends it lg p times: n lg p per phase on the critical path, twice the ring's 2(p-1)/p n at best.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..costs.alpha_beta import lg
from .p2p import Traffic, exchange, finish, flat_work, reducer
from .trace import Trace


def _reduce(flat, root, op, traffic, trace) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    combine, vr = reducer(op), (rank - root) % p
    tmp = torch.empty_like(flat)
    done = False
    for k in range(lg(p)):
        mask, sends = 1 << k, []
        if not done and vr % (2 * mask) == mask:          # my subtree is complete: hand it to my parent
            dst = (vr - mask + root) % p
            exchange(send=flat, dst=dst, traffic=traffic)
            sends, done = [(rank, dst, 0, flat.numel() * flat.element_size())], True
        elif not done and vr % (2 * mask) == 0 and vr + mask < p:   # a child's subtree arrives
            exchange(recv=tmp, src=(vr + mask + root) % p, traffic=traffic)
            combine(flat, tmp)
        if trace is not None:
            trace.record("reduce", sends, flat)


def _broadcast(flat, root, traffic, trace) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    vr = (rank - root) % p
    for k in reversed(range(lg(p))):
        mask, sends = 1 << k, []
        if vr % (2 * mask) == 0 and vr + mask < p:
            dst = (vr + mask + root) % p
            exchange(send=flat, dst=dst, traffic=traffic)
            sends = [(rank, dst, 0, flat.numel() * flat.element_size())]
        elif vr % (2 * mask) == mask:
            exchange(recv=flat, src=(vr - mask + root) % p, traffic=traffic)
        if trace is not None:
            trace.record("broadcast", sends, flat)


def tree_all_reduce(tensor: torch.Tensor, op="sum", root: int = 0, traffic: Traffic | None = None,
                    trace: Trace | None = None) -> torch.Tensor:
    """In-place all-reduce as binomial-tree reduce to `root` then binomial-tree broadcast: 2 lg p steps."""
    flat = flat_work(tensor)
    if trace is not None:
        trace.begin("tree all-reduce", dist.get_rank(), dist.get_world_size(), [(0, flat.numel())], flat)
    _reduce(flat, root, op, traffic, trace)
    _broadcast(flat, root, traffic, trace)
    return finish(tensor, flat)
