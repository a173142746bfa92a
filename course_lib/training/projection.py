"""Step time and scaling efficiency of synchronous PS and ring all-reduce from the cost model (notebook 10).

The communication terms are course_lib.costmodel's (BytePS section 3.1; Patarasuk & Yuan 2009); this module only
adds what one synchronous step of the course's trainers does on top: compute, and push and pull one after the
other (the server cannot send new weights before the last gradient is in, so the two directions of its link do
not overlap here; BytePS overlaps them by pipelining many tensors, which halves the PS term).
"""

from __future__ import annotations

from .. import costmodel
from .netem import Link


def ps_step(n: int, model_bytes: float, link: Link, k_servers: int = 1, compute_s: float = 0.0) -> float:
    """Seconds per synchronous PS step: compute + push + pull, each max(M/B, nM/(kB)) (costmodel.ps_vs_allreduce),
    plus the messages' latency: a worker's push (alpha) and a server sending its n shards one after another."""
    comm = costmodel.ps_vs_allreduce(n, model_bytes, link.bandwidth, k_servers)["ps_s"]
    return compute_s + 2 * comm + (1 + n) * link.alpha


def ring_step(n: int, model_bytes: float, link: Link, compute_s: float = 0.0) -> float:
    """Seconds per data-parallel step with one ring all-reduce of the whole model: compute +
    costmodel.ring_allreduce (2(n-1) alpha + 2(n-1)/n M beta)."""
    return compute_s + costmodel.ring_allreduce(n, model_bytes, link.alpha, link.beta)


def project(ns, model_bytes: float, link: Link, compute_s: float = 0.0, k_servers=(1,)) -> dict:
    """Step seconds and scaling efficiency (compute_s / step(n): one process that only computes, divided by the
    n-worker step, per-worker batch fixed) for each n in ns:
    {"ring": {...}, "ps k=1": {...}, ...}, each {"n": [...], "step_s": [...], "efficiency": [...]}."""
    curves = {"ring": [ring_step(n, model_bytes, link, compute_s) for n in ns]}
    for k in k_servers:
        curves[f"ps k={k}"] = [ps_step(n, model_bytes, link, k, compute_s) for n in ns]
    out = {}
    for name, ts in curves.items():
        # against one process that only computes: the communication-free ideal every architecture is measured by
        base = compute_s if compute_s > 0 else ts[0]
        out[name] = {"n": list(ns), "step_s": ts, "efficiency": [base / t if t > 0 else 1.0 for t in ts]}
    return out
