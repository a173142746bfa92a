"""Context parallelism by ring attention: blockwise attention with the online softmax, K/V blocks passed round a ring.

Taught in notebooks/15b_context_parallel_and_layouts.ipynb. Online softmax: keep a running row maximum m and row sum
l, rescale what was accumulated by exp(m_old - m_new) when a new block raises the maximum (Milakov & Gimelshein
2018, "Online normalizer calculation for softmax", algorithm 3); the output's numerator o is carried along with them
(Rabe & Staats 2021, arXiv:2112.05682; blockwise in FlashAttention, Dao et al. 2022).
Ring attention: each of p ranks holds S/p queries, keys and values; the key/value blocks travel round the ring
while every rank folds each arriving block into its own queries' attention, sending the next block while it
computes (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context",
arXiv:2310.01889, section 3). Causal masking by global positions, so any layout of the sequence works.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from ..collectives.p2p import post_together
from ..measure import emulated_link


def attention(q, k, v, causal: bool = False, q_pos=None, k_pos=None):
    """softmax(q k^T / sqrt(d)) v on one process, the reference (causal: key position <= query position)."""
    s = q @ k.T / math.sqrt(q.shape[-1])
    if causal:
        q_pos = torch.arange(len(q)) if q_pos is None else q_pos
        k_pos = torch.arange(len(k)) if k_pos is None else k_pos
        s = s.masked_fill(k_pos[None, :].to(s.device) > q_pos[:, None].to(s.device), float("-inf"))
    return s.softmax(-1) @ v


def online_update(o, m, den, s, v):
    """Fold one block of scores s (rows x keys, -inf where masked) with its values v into the running (o, m, den):
    o accumulates exp(s - m) v unnormalised, m is the running row maximum, den the running row sum of exp(s - m)
    (the softmax denominator). In place, as a fused kernel would: o and den are rescaled and added to, s becomes
    exp(s - m); returns the new m."""
    m_new = torch.maximum(m, s.amax(-1))
    base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)   # a row with nothing seen yet
    scale = torch.exp(m - base)                     # rescales what was accumulated under the old maximum
    w = s.sub_(base[:, None]).exp_()
    o.mul_(scale[:, None]).addmm_(w, v)
    den.mul_(scale).add_(w.sum(-1))
    return m_new


def positions(rank: int, p: int, seq: int, layout: str = "contiguous") -> torch.Tensor:
    """Global positions of the tokens a rank holds. contiguous: block r of p; zigzag: chunks r and 2p-1-r of 2p
    (the load-balanced causal layout used by Llama 3's context parallelism, Dubey et al. 2024, section 3.3.2)."""
    if layout == "contiguous":
        c = seq // p
        return torch.arange(rank * c, (rank + 1) * c)
    if layout == "zigzag":
        c = seq // (2 * p)
        return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * p - 1 - rank) * c,
                                                                                 (2 * p - rank) * c)])
    raise ValueError(f"layout is 'contiguous' or 'zigzag', not {layout!r}")


def ring_attention(q, k, v, causal: bool = False, layout: str = "contiguous", overlap: bool = True,
                   flops: float | None = None, stats: dict | None = None):
    """This rank's attention output for its own queries (the library copy of notebook 15b's cell). q, k, v: this
    rank's blocks; the pair (k, v) goes to rank+1 and comes from rank-1 at every step. overlap=False waits for the next
    block before computing (the naive order). Causal blocks are computed whole and masked (no half-block kernel). flops:
    an emulated FLOP/s; each computed block then also charges 4 c c d / flops seconds with emulated_link.compute, on the
    link's virtual clock inside emulated_link.emulate(link), so a step lasts what the schedule takes on that link, on
    any machine. stats, if given, gets the blocks computed, the messages sent, per step (whose block, computed or
    skipped) and each step's seconds by emulated_link.now()."""
    rank, p = dist.get_rank(), dist.get_world_size()
    seq = len(q) * p
    q_pos = positions(rank, p, seq, layout)
    kv = torch.stack([k, v])                         # one message per step carries both
    qs = q / math.sqrt(q.shape[-1])                  # scaled once, not at every step
    o = torch.zeros_like(q)
    m = torch.full((len(q),), float("-inf"), dtype=q.dtype, device=q.device)
    den = torch.zeros(len(q), dtype=q.dtype, device=q.device)
    computed = messages = 0
    trace, step_s = [], []
    for step in range(p):
        src = (rank - step) % p                      # whose keys and values I hold now
        nxt, reqs, t0 = None, [], emulated_link.now()
        if step < p - 1:
            nxt = torch.empty_like(kv)
            # one batch: an isend then an irecv posted apart deadlock the ring on NCCL (notebook 04)
            reqs = post_together([(kv, (rank + 1) % p)], [(nxt, (rank - 1) % p)])
            messages += 1
            if not overlap:
                _wait(reqs)
        s = qs @ kv[0].T
        if causal:
            k_pos = positions(src, p, seq, layout).to(s.device)
            s.masked_fill_(k_pos[None, :] > q_pos[:, None].to(s.device), float("-inf"))
        if not causal or not torch.isinf(s).all():   # a block entirely in the future adds nothing
            m = online_update(o, m, den, s, kv[1])
            computed += 1
            if flops:
                emulated_link.compute(4 * len(q) * kv.shape[1] * q.shape[-1] / flops)   # q k^T and p v: 2 FLOPs per MAC
            trace.append((src, True))
        else:
            trace.append((src, False))
        del s
        if overlap and reqs:
            _wait(reqs)
        step_s.append(emulated_link.now() - t0)
        if nxt is not None:
            kv = nxt
    if stats is not None:
        stats.update(blocks=computed, messages=messages, steps=trace, step_s=step_s)
    return o / den[:, None]


def _wait(reqs):
    for r in reqs:
        r.wait()


def traffic_formula(seq: int, d: int, p: int, elem: int) -> int:
    """Bytes each rank sends (and receives) in one ring attention: p-1 steps of its K and V block, 2 (S/p) d each."""
    return (p - 1) * 2 * (seq // p) * d * elem


def memory_formula(seq: int, d: int, p: int, elem: int) -> int:
    """Bytes a rank must hold at once beyond its inputs: the scaled queries and the output (c x d each), the K/V
    pair it computes with and, when p > 1, the one arriving (2 c d each), the c x c score block; c = S/p. Row
    vectors (the running max and sum, O(c)) come on top. At p = 1 this is one-process attention done blockwise."""
    c = seq // p
    return (2 * c * d + (4 if p > 1 else 2) * c * d + c * c) * elem


def causal_pairs(seq: int, p: int, layout: str) -> list[int]:
    """(query, key) pairs each rank must compute under a causal mask: its work, exactly, for a layout."""
    return [int(sum(int(t) + 1 for t in positions(r, p, seq, layout))) for r in range(p)]


def overlap_model(c, d: int, flops: float, bandwidth: float, elem: int, alpha: float = 0.0,
                  kv_fraction: float = 1.0) -> dict:
    """One ring step for blocks of c tokens and attention width d: compute 4 c^2 d / flops (q k^T and p v, 2 FLOPs
    per multiply-add), transfer alpha + 2 c (kv_fraction d) elem / bandwidth (K and V; kv_fraction < 1 with
    grouped-query attention, whose K/V heads are fewer than its query heads). With overlap a step takes the larger."""
    compute = 4 * c * c * d / flops
    transfer = alpha + 2 * c * d * kv_fraction * elem / bandwidth
    return {"compute": compute, "transfer": transfer, "overlapped": np.maximum(compute, transfer),
            "serial": compute + transfer}


def crossover(flops: float, bandwidth: float, elem: int, kv_fraction: float = 1.0) -> float:
    """Block length c at which compute 4 c^2 d / F equals transfer 2 c d f elem / B (alpha = 0): c = f elem F / (2B).
    In bf16 (elem = 2) without GQA that is F / B, Liu et al. 2023's condition (section 3): block size >= F / B."""
    return kv_fraction * elem * flops / (2 * bandwidth)
