"""Step time and scaling efficiency of synchronous PS and ring all-reduce from the cost model (notebook 10).

The communication terms are course_lib.costs.alpha_beta's (BytePS, Jiang et al. OSDI'20, section 2; Patarasuk & Yuan
2009). One PS model, with pipelining as a switch: push then pull (the server sends new weights only after the last
gradient is in, as course_lib.training.ps does) costs both directions of the busiest NIC one after the other;
pipelined (BytePS: tensors cut into pieces, a piece pulled while the next is pushed) costs one direction.
"""

from __future__ import annotations

from ..measure.emulated_link import Link
from . import alpha_beta

MODES = {"push then pull": False, "pipelined": True}


def ps_step(n: int, model_bytes: float, link: Link, k_servers: int = 1, compute_s: float = 0.0,
            pipelined: bool = False) -> float:
    """Seconds per synchronous PS step: compute + alpha_beta.ps_vs_allreduce's PS time (2 max(M/B, nM/(kB)) push
    then pull, max(M/B, nM/(kB)) pipelined), plus the messages' latency: a worker's push (alpha) and a server
    sending its n shards one after another (n alpha)."""
    comm = alpha_beta.ps_vs_allreduce(n, model_bytes, link.bandwidth, k_servers, pipelined)["ps_s"]
    return compute_s + comm + (1 + n) * link.alpha


def ring_step(n: int, model_bytes: float, link: Link, compute_s: float = 0.0) -> float:
    """Seconds per data-parallel step with one ring all-reduce of the whole model: compute +
    alpha_beta.ring_allreduce (2(n-1) alpha + 2(n-1)/n M beta)."""
    return compute_s + alpha_beta.ring_allreduce(n, model_bytes, link.alpha, link.beta)


def project(ns, model_bytes: float, link: Link, compute_s: float = 0.0, k_servers=(1,),
            modes=("push then pull",)) -> dict:
    """Step seconds and scaling efficiency (compute_s / step(n): one process that only computes, divided by the
    n-worker step, per-worker batch fixed) for each n in ns: {"ring": {...}, "ps k=1 push then pull": {...},
    "ps k=1 pipelined": {...}, ...} (one PS curve per k and mode), each {"n": [...], "step_s": [...],
    "efficiency": [...]}."""
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"modes must be among {sorted(MODES)}, got {sorted(unknown)}")
    curves = {"ring": [ring_step(n, model_bytes, link, compute_s) for n in ns]}
    for k in k_servers:
        for mode in modes:
            curves[f"ps k={k} {mode}"] = [ps_step(n, model_bytes, link, k, compute_s, MODES[mode]) for n in ns]
    out = {}
    for name, ts in curves.items():
        # against one process that only computes: the communication-free ideal every architecture is measured by
        base = compute_s if compute_s > 0 else ts[0]
        out[name] = {"n": list(ns), "step_s": ts, "efficiency": [base / t if t > 0 else 1.0 for t in ts]}
    return out
