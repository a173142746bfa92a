"""Ring reduce-scatter, ring all-gather and ring all-reduce (= reduce-scatter + all-gather) from isend/irecv.

Patarasuk & Yuan, JPDC 2009 (bandwidth-optimal all-reduce); taught in notebooks/06_build_your_own_collectives.ipynb.
The tensor is cut into p chunks whose sizes differ by at most one element (torch.tensor_split), so any size works.
At step s rank r sends one chunk to r+1 and receives one from r-1: p-1 steps per phase, 2(p-1)/p n bytes per rank
when p divides n.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .p2p import Traffic, exchange, finish, flat_work, post_together, reducer
from .trace import Trace


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """Element ranges of p chunks of n elements, the first n % p one element longer (torch.tensor_split's rule)."""
    q, extra = divmod(n, p)
    bounds, lo = [], 0
    for i in range(p):
        hi = lo + q + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


SEGMENT_BYTES = 1 << 20   # as gloo (gloo/allreduce.cc): pieces of at most 1 MiB, so each add works on cached data


def _pieces(lo: int, hi: int, seg: int) -> list[tuple[int, int]]:
    return [(a, min(a + seg, hi)) for a in range(lo, hi, seg)]


def _ring(members):
    """(this rank's place in the ring, ring size, right neighbour, left neighbour) as world ranks.

    members: the ring's world ranks in ring order (default: every rank); the hierarchical all-reduce runs rings
    over the GPUs of one node and over GPU i of every node.
    """
    rank = dist.get_rank()
    members = list(range(dist.get_world_size())) if members is None else list(members)
    i, p = members.index(rank), len(members)
    return i, p, members[(i + 1) % p], members[(i - 1) % p]


def _reduce_scatter(flat, bounds, op, traffic, trace, members=None) -> None:
    """p-1 steps; afterwards chunk i of the ring's i-th rank holds the reduction of every ring rank's chunk i.

    Within a step the chunk moves in segments of at most SEGMENT_BYTES, each sent and received as one batch
    (post_together: on NCCL unbatched sends and receives would deadlock the ring) into a two-slot buffer. Same
    bytes, same steps as sending the chunk whole (the notebook's version).
    """
    rank = dist.get_rank()
    i, p, right, left = _ring(members)
    combine = reducer(op)
    seg = max(1, SEGMENT_BYTES // flat.element_size())
    tmp = torch.empty(2 * min(seg, max(hi - lo for lo, hi in bounds)), dtype=flat.dtype, device=flat.device)
    for s in range(p - 1):
        # Shifted by one so the chunk finished last is chunk i (chunk r on a ring of all ranks), as in torch's
        # reduce_scatter.
        out_c, in_c = (i - s - 1) % p, (i - s - 2) % p
        (olo, ohi), (ilo, ihi) = bounds[out_c], bounds[in_c]
        sends, pieces = _pieces(olo, ohi, seg), _pieces(ilo, ihi, seg)
        for k in range(max(len(sends), len(pieces))):
            out = [(flat[a:b], right) for a, b in sends[k:k + 1]]
            slot = [(tmp[(k % 2) * seg:(k % 2) * seg + (b - a)], left) for a, b in pieces[k:k + 1]]
            for w in post_together(out, slot):
                w.wait()
            for (a, b), (buf, _) in zip(pieces[k:k + 1], slot):
                combine(flat[a:b], buf)
        if traffic is not None:
            es = flat.element_size()
            traffic.bytes_sent += (ohi - olo) * es
            traffic.bytes_recv += (ihi - ilo) * es
            traffic.messages_sent += len(sends)
        if trace is not None:
            trace.record("reduce-scatter", [(rank, right, out_c, (ohi - olo) * flat.element_size())], flat)


def _all_gather(flat, bounds, traffic, trace, members=None) -> None:
    """p-1 steps; the ring's i-th rank starts owning chunk i and passes what it last received to its right."""
    rank = dist.get_rank()
    i, p, right, left = _ring(members)
    for s in range(p - 1):
        out_c, in_c = (i - s) % p, (i - s - 1) % p
        (olo, ohi), (ilo, ihi) = bounds[out_c], bounds[in_c]
        exchange(flat[olo:ohi], right, flat[ilo:ihi], left, traffic)
        if trace is not None:
            trace.record("all-gather", [(rank, right, out_c, (ohi - olo) * flat.element_size())], flat)


def ring_reduce_scatter(tensor: torch.Tensor, op="sum", traffic: Traffic | None = None,
                        trace: Trace | None = None) -> torch.Tensor:
    """Reduce `tensor` over all ranks and return this rank's chunk (chunk r of p, tensor_split sizes).

    The input is used as the workspace (its other chunks hold partial sums afterwards); the result is a view.
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    flat = flat_work(tensor)
    bounds = chunk_bounds(flat.numel(), p)
    if trace is not None:
        trace.begin("ring reduce-scatter", rank, p, bounds, flat)
    _reduce_scatter(flat, bounds, op, traffic, trace)
    lo, hi = bounds[rank]
    return flat[lo:hi]


def ring_all_gather(chunk: torch.Tensor, sizes: list[int] | None = None, traffic: Traffic | None = None,
                    trace: Trace | None = None) -> torch.Tensor:
    """Every rank's chunk, concatenated in rank order, on every rank (1-D). `sizes`: each rank's chunk length
    (default: all equal to this rank's), so uneven chunks work, which torch's all_gather does not allow."""
    rank, p = dist.get_rank(), dist.get_world_size()
    sizes = [chunk.numel()] * p if sizes is None else list(sizes)
    if sizes[rank] != chunk.numel():
        raise ValueError(f"rank {rank}: sizes[{rank}]={sizes[rank]} but the chunk has {chunk.numel()} elements")
    bounds, lo = [], 0
    for n in sizes:
        bounds.append((lo, lo + n))
        lo += n
    out = torch.zeros(lo, dtype=chunk.dtype, device=chunk.device)
    out[bounds[rank][0]:bounds[rank][1]] = chunk.reshape(-1)
    if trace is not None:
        trace.begin("ring all-gather", rank, p, bounds, out)
    _all_gather(out, bounds, traffic, trace)
    return out


def ring_all_reduce(tensor: torch.Tensor, op="sum", traffic: Traffic | None = None,
                    trace: Trace | None = None) -> torch.Tensor:
    """In-place all-reduce of `tensor` by ring reduce-scatter then ring all-gather; returns `tensor`.

    Same result as dist.all_reduce(tensor, op) for any world size >= 1 and any number of elements.
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    flat = flat_work(tensor)
    bounds = chunk_bounds(flat.numel(), p)
    if trace is not None:
        trace.begin("ring all-reduce", rank, p, bounds, flat)
    _reduce_scatter(flat, bounds, op, traffic, trace)
    _all_gather(flat, bounds, traffic, trace)
    return finish(tensor, flat)
