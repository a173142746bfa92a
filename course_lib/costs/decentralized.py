"""What each training scheme of notebook 11b sends per step, and its step time from the cost model.

Bytes are exact for the course's implementations (every message counted by measure.traffic must equal them);
seconds use course_lib.costs.alpha_beta's alpha-beta terms on one full-duplex link per rank, the model
measure/emulated_link.py emulates:
a rank's outgoing messages go one after another, alpha + bytes/B each. Sources: BytePS (Jiang et al. OSDI'20) and
Patarasuk & Yuan 2009 for PS and ring all-reduce (training/projection.py); gossip sends its model to each
out-neighbour (Lian et al. NeurIPS 2017; Ying et al. NeurIPS 2021); local SGD and DiLoCo all-reduce once per H steps
(Stich ICLR 2019; Douillard et al. 2023); PowerSGD all-reduces two small matrices per step (Vogels et al. NeurIPS
2019); top-k all-gathers k values and k indices (Stich et al. NeurIPS 2018).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..measure.emulated_link import Link
from ..training.compression import powersgd_sizes, ring_sent_bytes, topk_sent_bytes
from ..training.gossip import out_neighbours, tau
from . import alpha_beta, projection


@dataclass(frozen=True)
class Scheme:
    """One way to train on p ranks: kind in ps, allreduce, gossip, local, diloco, powersgd, topk. `inner`: "adamw"
    for local SGD with DiLoCo's AdamW inner steps (its control; the bytes are local SGD's)."""

    kind: str
    topology: str = ""
    H: int = 1
    r: int = 2
    k_fraction: float = 0.01
    inner: str = ""


SCHEMES = {
    "sync PS": Scheme("ps"),
    "all-reduce DP": Scheme("allreduce"),
    "gossip, ring": Scheme("gossip", topology="ring"),
    "gossip, one-peer exp.": Scheme("gossip", topology="one-peer exponential"),
    "local SGD, H=16": Scheme("local", H=16),
    "DiLoCo, H=16": Scheme("diloco", H=16),
    "PowerSGD, r=2": Scheme("powersgd", r=2),
    "top-k 1%": Scheme("topk", k_fraction=0.01),
    "PowerSGD, r=1": Scheme("powersgd", r=1),
    "PowerSGD, r=4": Scheme("powersgd", r=4),
    "top-k 10%": Scheme("topk", k_fraction=0.1),
    "local AdamW, H=16": Scheme("local", H=16, inner="adamw"),
}
# in the cost model only (nothing here trains with it): NCCL's other all-reduce algorithm, a pipelined double tree
MODEL_ONLY = {"all-reduce DP, tree": Scheme("allreduce", topology="tree"),
              "PowerSGD, r=2, tree": Scheme("powersgd", topology="tree", r=2)}
# the side by side of notebook 11b; the others are trained for their loss only: three more ranks and fractions for
# its compression figure, and DiLoCo's control (the same AdamW inner steps, a plain average instead of the outer step)
MAIN = tuple(SCHEMES)[:8]


def sent_per_step(s: Scheme, p: int, shapes, rank: int = 0) -> float:
    """Bytes `rank` sends per step (a mean over H steps for local SGD and DiLoCo). p = workers; for the PS, rank 0
    is the server (p M) and any other rank a worker (M). shapes: the model's parameter shapes (float32)."""
    numel = sum(_numel(sh) for sh in shapes)
    m = 4 * numel
    if s.kind == "ps":
        return p * m if rank == 0 else m
    if s.kind == "allreduce" and s.topology == "tree":
        return 2 * m if p > 1 else 0.0                                      # the root sends m, everyone else 2m
    if s.kind in ("allreduce", "local", "diloco"):
        return ring_sent_bytes(numel, p, rank) / s.H
    if s.kind == "gossip":
        steps = tau(p) if s.topology == "one-peer exponential" else 1     # the one-peer graph cycles: any step
        return sum(len(out_neighbours(s.topology, p, rank, t)) for t in range(steps)) / steps * m
    if s.kind == "powersgd":
        a, b = powersgd_sizes(shapes, s.r)
        if s.topology == "tree":
            return 2 * 4 * (a + b) if p > 1 else 0.0
        return ring_sent_bytes(a, p, rank) + ring_sent_bytes(b, p, rank)
    if s.kind == "topk":
        return topk_sent_bytes(max(1, int(s.k_fraction * numel)), p)
    raise ValueError(f"unknown scheme kind {s.kind!r}")


def step_seconds(s: Scheme, n: int, shapes, link: Link, compute_s: float = 0.0) -> float:
    """Projected seconds per step on n workers: compute + the cost model's communication time on `link`."""
    numel = sum(_numel(sh) for sh in shapes)
    m, a, b = 4 * numel, link.alpha, link.beta
    if s.kind == "ps":
        return projection.ps_step(n, m, link, 1, compute_s)
    if s.kind == "allreduce" and s.topology == "tree":
        return compute_s + alpha_beta.double_tree_allreduce(n, m, a, b)
    if s.kind == "allreduce":
        return projection.ring_step(n, m, link, compute_s)
    if s.kind in ("local", "diloco"):
        return compute_s + alpha_beta.ring_allreduce(n, m, a, b) / s.H
    if s.kind == "gossip":
        d = 1 if s.topology == "one-peer exponential" else len(out_neighbours(s.topology, n, 0))
        return compute_s + d * (a + m * b)      # d sends one after another on the outgoing side
    if s.kind == "powersgd":
        first, second = powersgd_sizes(shapes, s.r)
        if s.topology == "tree":           # its two small all-reduces on NCCL's tree: 2 lg p latencies each
            return (compute_s + alpha_beta.double_tree_allreduce(n, 4 * first, a, b)
                    + alpha_beta.double_tree_allreduce(n, 4 * second, a, b))
        return (compute_s + alpha_beta.ring_allreduce(n, 4 * first, a, b)
                + alpha_beta.ring_allreduce(n, 4 * second, a, b))
    if s.kind == "topk":
        k = max(1, int(s.k_fraction * numel))
        return compute_s + 2 * alpha_beta.ring_all_gather(n, 4 * k * n, a, b)   # values, then indices
    raise ValueError(f"unknown scheme kind {s.kind!r}")


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
