"""The alpha-beta(-gamma) cost model of collectives, and a fit of alpha and beta from measured times (notebooks 06-07).

alpha = seconds per message (latency), beta = seconds per byte on one link in one direction (1 / bandwidth),
gamma = seconds per byte to reduce (add) locally, p = ranks, n = bytes of the whole tensor on each rank.

Formulas: Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 19(1), 2005 (sections 4.4-4.6); Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 69(2), 2009 (ring); Jiang et al., "A Unified Architecture for Accelerating Distributed DNN
Training in Heterogeneous GPU/CPU Clusters" (BytePS), OSDI 2020, section 2 (PS vs all-reduce).
Every function returns seconds; ``lg`` is log2 rounded up, the number of rounds a tree or doubling needs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def lg(p: int) -> int:
    """Rounds of a binomial tree / recursive doubling over p ranks: ceil(log2 p) (0 for one rank)."""
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    return (p - 1).bit_length()


def ring_reduce_scatter(p: int, n_bytes: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Ring reduce-scatter: (p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma (Thakur et al. 2005; Patarasuk-Yuan)."""
    return (p - 1) * alpha + (p - 1) / p * n_bytes * (beta + gamma)


def ring_all_gather(p: int, n_bytes: float, alpha: float, beta: float) -> float:
    """Ring all-gather of a result of n bytes: (p-1) alpha + (p-1)/p n beta (Thakur et al. 2005, section 4.1)."""
    return (p - 1) * alpha + (p - 1) / p * n_bytes * beta


def ring_allreduce(p: int, n_bytes: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Ring all-reduce = ring reduce-scatter + ring all-gather: 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma.

    An all-reduce built from point-to-point sends and receives moves at least 2(p-1) n bytes in all (nccl-tests
    doc/PERFORMANCE.md, "as long as they use point-to-point operations"), 2(p-1)/p n per rank on average; the ring
    meets it on every rank (Patarasuk & Yuan 2009, bandwidth-optimal). A switch that adds (NVLink SHARP) lets each
    GPU send less; recursive doubling sends more (allreduce_traffic).
    """
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n_bytes * beta + (p - 1) / p * n_bytes * gamma


def recursive_doubling_allreduce(p: int, n_bytes: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Recursive doubling all-reduce: lg p alpha + n lg p beta + n lg p gamma (Thakur et al. 2005, section 4.5)."""
    k = lg(p)
    return k * alpha + n_bytes * k * (beta + gamma)


def rabenseifner_allreduce(p: int, n_bytes: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Reduce-scatter by recursive halving + all-gather by recursive doubling (Rabenseifner; Thakur et al. 2005).

    p a power of two: 2 lg p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma. Other p: MPICH's fold to the largest power
    of two below p costs two more messages of the whole tensor and one more reduction, (2 floor(lg p) + 2) alpha +
    (2 (p-1)/p + 2) n beta + (1 + (p-1)/p) n gamma (MPICH, allreduce_intra_reduce_scatter_allgather.c's header).
    """
    if p & (p - 1) == 0:
        return 2 * lg(p) * alpha + 2 * (p - 1) / p * n_bytes * beta + (p - 1) / p * n_bytes * gamma
    k = p.bit_length() - 1                                        # floor(lg p)
    return (2 * k + 2) * alpha + (2 * (p - 1) / p + 2) * n_bytes * beta + (1 + (p - 1) / p) * n_bytes * gamma


def binomial_reduce(p: int, n_bytes: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Binomial-tree reduce to one root: lg p (alpha + n beta + n gamma) (Thakur et al. 2005, section 4.4)."""
    return lg(p) * (alpha + n_bytes * (beta + gamma))


def binomial_broadcast(p: int, n_bytes: float, alpha: float, beta: float) -> float:
    """Binomial-tree broadcast from one root: lg p (alpha + n beta) (Thakur et al. 2005, section 4.1)."""
    return lg(p) * (alpha + n_bytes * beta)


def tree_allreduce(p: int, n_bytes: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Binomial-tree reduce then broadcast: 2 lg p alpha + 2 n lg p beta + n lg p gamma (Thakur et al. 2005)."""
    return binomial_reduce(p, n_bytes, alpha, beta, gamma) + binomial_broadcast(p, n_bytes, alpha, beta)


def double_tree_allreduce(p: int, n_bytes: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """NCCL's tree all-reduce, pipelined over two binary trees: 2 lg p alpha + 2 n beta + n gamma.

    A rank is inside one tree and a leaf of the other, each tree carrying half the data: it sends about 2n in all
    (an NCCL developer, NVIDIA/nccl issue 457: "for tree it would be 2*S"), against the ring's 2(p-1)/p n, and a
    chunk climbs lg p levels to the root and comes down lg p (Sanders, Speck & Traff 2009, two-tree algorithms).
    """
    return 2 * lg(p) * alpha + 2 * n_bytes * beta + n_bytes * gamma


def hierarchical_allreduce(nodes: int, per_node: int, n_bytes: float, alpha_in: float, beta_in: float,
                           alpha_out: float, beta_out: float) -> float:
    """2-D (hierarchical) all-reduce: ring reduce-scatter inside each node, ring all-reduce of each 1/per_node shard
    across the nodes (GPU i of every node, each with its own NIC), ring all-gather inside the node (Mikami et al.,
    "Massively Distributed SGD", arXiv:1811.05233, 2018, 2D-torus all-reduce). The slow links carry n/per_node.
    """
    inside = ring_reduce_scatter(per_node, n_bytes, alpha_in, beta_in) + ring_all_gather(per_node, n_bytes, alpha_in,
                                                                                           beta_in)
    return inside + ring_allreduce(nodes, n_bytes / per_node, alpha_out, beta_out)


def star_allreduce(p: int, n_bytes: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Naive star: the root receives p-1 tensors, reduces, sends p-1 back over its one link (2(p-1) n bytes).

    2 (p-1) alpha + 2 (p-1) n beta + (p-1) n gamma: the root's link is the bottleneck (Thakur et al. 2005, as the
    baseline the tree and ring improve on).
    """
    return 2 * (p - 1) * (alpha + n_bytes * beta) + (p - 1) * n_bytes * gamma


def allreduce_traffic(algorithm: str, p: int, n_bytes: int) -> dict:
    """Bytes sent by the busiest rank and by all ranks together in one all-reduce of n bytes on p ranks.

    ring: 2(p-1)/p n per rank (p dividing n), 2(p-1) n in all, however n splits; tree (binomial reduce +
    broadcast): the root sends n lg p, 2(p-1) n in all; recursive doubling: n lg p per rank, p n lg p in all
    (p a power of two; otherwise MPICH's fold adds n for 2(p - 2^floor(lg p)) ranks); star: the root sends
    (p-1) n and receives as much, 2(p-1) n in all. Same total for ring, tree and star: they differ in how it is
    spread over ranks and rounds, which is what the time formulas above capture.
    """
    k = lg(p)
    pof2 = 1 << (p.bit_length() - 1)
    busiest = {"ring": 2 * (p - 1) / p * n_bytes, "tree": k * n_bytes, "recursive_doubling": k * n_bytes,
               "star": (p - 1) * n_bytes}[algorithm]
    total = {"ring": 2 * (p - 1) * n_bytes, "tree": 2 * (p - 1) * n_bytes, "star": 2 * (p - 1) * n_bytes,
             "recursive_doubling": (2 * (p - pof2) + pof2 * lg(pof2)) * n_bytes}[algorithm]
    return {"busiest": busiest, "total": total}


ALLREDUCE = {
    "ring": ring_allreduce,
    "recursive_doubling": recursive_doubling_allreduce,
    "rabenseifner": rabenseifner_allreduce,
    "tree": tree_allreduce,
    "star": star_allreduce,
}


def ps_vs_allreduce(n_workers: int, model_bytes: float, bandwidth: float, k_servers: int = 1,
                    pipelined: bool = True) -> dict:
    """Per-iteration communication time of PS and ring all-reduce (BytePS, Jiang et al. OSDI'20, section 2).

    B = bytes/s one way per full-duplex NIC. all-reduce: 2 (n-1) M / (n B). A PS with k servers on machines of
    their own: each worker pushes M and pulls M; each server receives and sends n M / k, so the busiest NIC needs
    max(M/B, n M / (k B)) per direction. pipelined=True (BytePS's analysis; its implementation splits tensors into
    pieces so that pulls of finished pieces run while later pieces are pushed): push and pull overlap, the PS takes
    that one direction's time. pipelined=False (a server that sends new weights only after the last gradient is in,
    as notebook 08's does): push, then pull, twice that.
    """
    n, m, b, k = n_workers, model_bytes, bandwidth, k_servers
    one_way = max(m / b, n * m / (k * b))
    return {
        "allreduce_s": 2 * (n - 1) * m / (n * b),
        "ps_s": one_way if pipelined else 2 * one_way,
        "ps_one_direction_s": one_way,
        "ps_server_bytes_in": n * m / k,
        "ps_server_bytes_out": n * m / k,
    }


def byteps_optimal(n_workers: int, model_bytes: float, bandwidth: float, k_cpu: int) -> float:
    """BytePS's communication time with k CPU machines beside n GPU machines, each summing its optimal share
    (Jiang et al. OSDI'20, Theorem 1): 2 n (n-1) M / ((n^2 + k n - 2k) B). k = 0 is ring all-reduce's 2(n-1)/n M/B,
    k = n a PS on n machines of their own, M/B."""
    n, k = n_workers, k_cpu
    return 2 * n * (n - 1) * model_bytes / ((n * n + k * n - 2 * k) * bandwidth)


def fit_alpha_beta(n_bytes: Iterable[float], seconds: Iterable[float], p: int = 2,
                   algorithm: str = "ring") -> tuple[float, float]:
    """Least-squares fit of (alpha, beta) so that ALLREDUCE[algorithm](p, n, alpha, beta) matches the measurements.

    The model is linear in alpha and beta: t = a(p) alpha + b(p, n) beta. Errors are weighted by 1/t (relative
    least squares), so that 4 KiB messages (microseconds) count as much as 64 MiB ones (tens of milliseconds);
    the fit minimises sum(((model - t) / t)^2). Both coefficients are clipped at zero.
    """
    xs, ts = list(map(float, n_bytes)), list(map(float, seconds))
    if len(xs) != len(ts) or len(xs) < 2:
        raise ValueError("need at least two (bytes, seconds) pairs of equal length")
    model = ALLREDUCE[algorithm] if algorithm in ALLREDUCE else None
    if model is None:
        raise ValueError(f"unknown algorithm {algorithm!r}; one of {sorted(ALLREDUCE)}")
    # The coefficient of alpha and of beta at each size, read off the model itself (it is linear in both).
    rows = [(model(p, n, 1.0, 0.0), model(p, n, 0.0, 1.0)) for n in xs]
    return _relative_lsq(rows, ts)


def _relative_lsq(rows, ts) -> tuple[float, float]:
    """(x, y) minimising sum(((a x + b y - t) / t)^2) over rows (a, b), both clipped at zero (costs are >= 0)."""
    saa = sab = sbb = sat = sbt = 0.0
    for (a, b), t in zip(rows, ts):
        w = 1.0 / (t * t)
        saa += w * a * a
        sab += w * a * b
        sbb += w * b * b
        sat += w * a * t
        sbt += w * b * t
    det = saa * sbb - sab * sab
    if abs(det) <= 1e-12 * saa * sbb:  # the columns are proportional: one size, or alpha and beta confounded
        raise ValueError("the sizes do not separate alpha from beta; measure at least two different sizes")
    alpha = (sat * sbb - sbt * sab) / det
    beta = (saa * sbt - sab * sat) / det
    if alpha < 0:  # latency cannot be negative: refit beta alone
        alpha, beta = 0.0, sbt / sbb
    if beta < 0:
        alpha, beta = sat / saa, 0.0
    return alpha, beta


def fit_line(n_bytes: Iterable[float], seconds: Iterable[float]) -> tuple[float, float]:
    """t = a + b n fitted to one operation's measured times (relative least squares): a in s, b in s/byte.

    The alpha-beta model of a whole collective, whatever its algorithm: a collects every per-message latency of the
    schedule, 1/b is the algorithm bandwidth it tends to (busbw = 1/b x the op's nccl-tests factor).
    """
    xs, ts = list(map(float, n_bytes)), list(map(float, seconds))
    if len(xs) != len(ts) or len(xs) < 2:
        raise ValueError("need at least two (bytes, seconds) pairs of equal length")
    return _relative_lsq([(1.0, x) for x in xs], ts)


def fit_pieces(n_bytes: Iterable[float], seconds: Iterable[float], tol: float = 0.25,
               max_pieces: int = 4, breaks: Iterable[float] | None = None) -> list[dict]:
    """Size ranges, each fitted by its own t = a + b n: the fewest that predict every point within tol, or the
    ranges that start at the given ``breaks`` (sizes where a new piece begins, e.g. where a library is known to
    switch algorithm).

    Where one line is not enough the model bends: a library switches algorithm or protocol with the size (NCCL picks
    the (algorithm, protocol) pair its own per-pair latency + size / bandwidth model says is fastest, then chunking
    and channels change with size), or data leaves the caches. Points must be sorted by size. Among splits with the
    same number of pieces the one with the smallest worst error wins. Each piece: lo, hi (bytes, inclusive), alpha,
    beta, max_rel_err, rel_errs.
    """
    xs, ts = list(map(float, n_bytes)), list(map(float, seconds))
    if xs != sorted(xs) or len(xs) != len(ts) or len(xs) < 2:
        raise ValueError("need at least two (bytes, seconds) pairs, sorted by size")

    def piece(i, j):  # points i..j-1
        a, b = fit_line(xs[i:j], ts[i:j])
        errs = [(a + b * x - t) / t for x, t in zip(xs[i:j], ts[i:j])]
        return {"lo": xs[i], "hi": xs[j - 1], "alpha": a, "beta": b, "rel_errs": errs,
                "max_rel_err": max(map(abs, errs))}

    n = len(xs)
    if breaks is not None:
        starts = [0] + [next(i for i, x in enumerate(xs) if x >= b) for b in sorted(breaks)]
        return [piece(i, j) for i, j in zip(starts, starts[1:] + [n])]
    for k in range(1, max_pieces + 1):
        best = None
        for cuts in _splits(n, k):
            bounds = [0, *cuts, n]
            pieces = [piece(i, j) for i, j in zip(bounds, bounds[1:])]
            worst = max(pc["max_rel_err"] for pc in pieces)
            if best is None or worst < best[0]:
                best = (worst, pieces)
        if best[0] <= tol:
            return best[1]
    raise ValueError(f"{max_pieces} pieces cannot fit every point within {tol:.0%}: the data are not piecewise linear")


def _splits(n: int, k: int):
    """Every way to cut n sorted points into k contiguous runs of at least 2 points (two points make a line)."""
    if k == 1:
        yield ()
        return
    for first in range(2, n - 2 * (k - 1) + 1):
        for rest in _splits(n - first, k - 1):
            yield (first, *(first + c for c in rest))


def predict_pieces(pieces: list[dict], n_bytes: float) -> float:
    """Seconds at n bytes from the piece whose size range holds n (the nearest piece outside the ranges)."""
    for pc in pieces:
        if pc["lo"] <= n_bytes <= pc["hi"]:
            return pc["alpha"] + pc["beta"] * n_bytes
    pc = pieces[0] if n_bytes < pieces[0]["lo"] else pieces[-1] if n_bytes > pieces[-1]["hi"] else min(
        pieces, key=lambda q: min(abs(n_bytes - q["lo"]), abs(n_bytes - q["hi"])))
    return pc["alpha"] + pc["beta"] * n_bytes


def tree_over_ring_ratio(p: int) -> float:
    """Bandwidth term of binomial reduce+broadcast over ring all-reduce: 2 lg p / (2 (p-1)/p) (large n)."""
    return 2 * lg(p) / (2 * (p - 1) / p) if p > 1 else math.nan
