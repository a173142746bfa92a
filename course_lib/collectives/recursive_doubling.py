"""Recursive-doubling all-reduce from isend/irecv: in round k every rank swaps its whole tensor with rank r XOR 2^k.

Thakur, Rabenseifner & Gropp, IJHPCA 2005 (section 4.5); taught in notebooks/06_build_your_own_collectives.ipynb.
lg p rounds, n bytes sent per round: few messages (good for small tensors), n lg p bytes (poor for large ones).
For p not a power of two, MPICH's fold: the first 2*rem ranks pair up, even ones hand their tensor to the odd
ones and sit out, the remaining power of two runs the doubling, then the odd ones hand the result back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .p2p import Traffic, exchange, finish, flat_work, reducer
from .trace import Trace


def recursive_doubling_all_reduce(tensor: torch.Tensor, op="sum", traffic: Traffic | None = None,
                                  trace: Trace | None = None) -> torch.Tensor:
    """In-place all-reduce by recursive doubling; same result as dist.all_reduce for any world size >= 1."""
    rank, p = dist.get_rank(), dist.get_world_size()
    combine = reducer(op)
    flat = flat_work(tensor)
    nbytes = flat.numel() * flat.element_size()
    if trace is not None:
        trace.begin("recursive doubling", rank, p, [(0, flat.numel())], flat)
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    tmp = torch.empty_like(flat)

    # Fold to a power of two: even ranks below 2*rem give their tensor to rank+1 and wait.
    if rem:
        sends = []
        if rank < 2 * rem and rank % 2 == 0:
            exchange(send=flat, dst=rank + 1, traffic=traffic)
            sends = [(rank, rank + 1, 0, nbytes)]
        elif rank < 2 * rem:
            exchange(recv=tmp, src=rank - 1, traffic=traffic)
            combine(flat, tmp)
        if trace is not None:
            trace.record("fold", sends, flat)
    # New rank among the pof2 survivors (-1: sitting out).
    if rank < 2 * rem:
        new = rank // 2 if rank % 2 else -1
    else:
        new = rank - rem

    def real(nr: int) -> int:
        return nr * 2 + 1 if nr < rem else nr + rem

    mask = 1
    while mask < pof2:
        sends = []
        if new >= 0:
            partner = real(new ^ mask)
            exchange(flat, partner, tmp, partner, traffic)
            combine(flat, tmp)
            sends = [(rank, partner, 0, nbytes)]
        if trace is not None:
            trace.record("doubling", sends, flat)
        mask <<= 1

    if rem:
        sends = []
        if rank < 2 * rem and rank % 2:
            exchange(send=flat, dst=rank - 1, traffic=traffic)
            sends = [(rank, rank - 1, 0, nbytes)]
        elif rank < 2 * rem:
            exchange(recv=flat, src=rank + 1, traffic=traffic)
        if trace is not None:
            trace.record("unfold", sends, flat)
    return finish(tensor, flat)
