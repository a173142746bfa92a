"""Rabenseifner's all-reduce from isend/irecv: reduce-scatter by recursive halving, all-gather by recursive doubling.

Thakur, Rabenseifner & Gropp, IJHPCA 19(1), 2005 (the section on allreduce); taught in
notebooks/06_build_your_own_collectives.ipynb. On p = 2^k ranks: lg p halving steps, in step d (d = p/2, p/4, ..., 1)
rank r swaps half of the chunks it still owns with rank r XOR d and adds the half it keeps, so that rank r ends
holding chunk r reduced (the order of MPICH's recursive-halving reduce-scatter; MPICH's allreduce starts at distance 1
instead, same cost); then lg p doubling steps in the opposite order hand the reduced chunks back. Each rank sends
(p-1)/p n in each phase: 2 lg p messages, 2(p-1)/p n bytes, the ring's bytes in lg p instead of p-1 steps.

Other p: MPICH's fold to the nearest lower power of two (pmodels/mpich,
src/mpi/coll/allreduce/allreduce_intra_reduce_scatter_allgather.c): the first 2*rem ranks pair up, each even one
sends its whole tensor to rank+1 and sits out, the 2^floor(lg p) others run the algorithm, then each odd one sends
the result back: two more steps and 2n more bytes on those ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .p2p import Traffic, exchange, finish, flat_work, reducer
from .ring import chunk_bounds
from .trace import Trace


def _span(flat, bounds, first: int, last: int) -> torch.Tensor:
    """The elements of chunks first .. last-1 (a contiguous view)."""
    return flat[bounds[first][0]:bounds[last - 1][1]]


def _halving(flat, bounds, new, pof2, real, op, traffic, trace) -> None:
    """Reduce-scatter by recursive halving among the pof2 ranks still in; afterwards chunk `new` is reduced."""
    rank, combine = dist.get_rank(), reducer(op)
    lo, hi, d = 0, pof2, pof2 // 2
    while d >= 1:
        sends = []
        if new >= 0:
            partner, mid = real(new ^ d), (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if (new & d) == 0 else ((mid, hi), (lo, mid))
            mine = _span(flat, bounds, *keep)
            incoming = torch.empty_like(mine)
            out = _span(flat, bounds, *give)
            exchange(out, partner, incoming, partner, traffic)
            combine(mine, incoming)
            sends = [(rank, partner, c, (bounds[c][1] - bounds[c][0]) * flat.element_size()) for c in range(*give)]
            lo, hi = keep
        if trace is not None:
            trace.record("halving", sends, flat)
        d //= 2


def _doubling(flat, bounds, new, pof2, real, traffic, trace) -> None:
    """All-gather by recursive doubling: the block of chunks a rank holds doubles at every step."""
    rank = dist.get_rank()
    d = 1
    while d < pof2:
        sends = []
        if new >= 0:
            partner = real(new ^ d)
            lo = new // d * d                     # my block: chunks lo .. lo+d-1; the partner's starts at lo ^ d
            theirs = lo ^ d
            exchange(_span(flat, bounds, lo, lo + d), partner, _span(flat, bounds, theirs, theirs + d), partner,
                     traffic)
            sends = [(rank, partner, c, (bounds[c][1] - bounds[c][0]) * flat.element_size())
                     for c in range(lo, lo + d)]
        if trace is not None:
            trace.record("doubling", sends, flat)
        d *= 2


def rabenseifner_all_reduce(tensor: torch.Tensor, op="sum", traffic: Traffic | None = None,
                            trace: Trace | None = None) -> torch.Tensor:
    """In-place all-reduce by recursive halving then recursive doubling; same result as dist.all_reduce, any p >= 1."""
    rank, p = dist.get_rank(), dist.get_world_size()
    combine = reducer(op)
    flat = flat_work(tensor)
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    bounds = chunk_bounds(flat.numel(), pof2)   # pof2 chunks, tensor_split sizes: any n works, some may be empty
    if trace is not None:
        trace.begin("Rabenseifner", rank, p, bounds, flat)

    # Fold to a power of two (MPICH): even ranks below 2*rem give their tensor to rank+1 and sit out (new = -1).
    if rem:
        sends = []
        if rank < 2 * rem and rank % 2 == 0:
            exchange(send=flat, dst=rank + 1, traffic=traffic)
            sends = [(rank, rank + 1, c, (b - a) * flat.element_size()) for c, (a, b) in enumerate(bounds)]
        elif rank < 2 * rem:
            tmp = torch.empty_like(flat)
            exchange(recv=tmp, src=rank - 1, traffic=traffic)
            combine(flat, tmp)
        if trace is not None:
            trace.record("fold", sends, flat)
    new = (rank // 2 if rank % 2 else -1) if rank < 2 * rem else rank - rem

    def real(nr: int) -> int:
        """The world rank of the survivor numbered nr."""
        return nr * 2 + 1 if nr < rem else nr + rem

    _halving(flat, bounds, new, pof2, real, op, traffic, trace)
    _doubling(flat, bounds, new, pof2, real, traffic, trace)

    if rem:
        sends = []
        if rank < 2 * rem and rank % 2:
            exchange(send=flat, dst=rank - 1, traffic=traffic)
            sends = [(rank, rank - 1, c, (b - a) * flat.element_size()) for c, (a, b) in enumerate(bounds)]
        elif rank < 2 * rem:
            exchange(recv=flat, src=rank + 1, traffic=traffic)
        if trace is not None:
            trace.record("unfold", sends, flat)
    return finish(tensor, flat)
