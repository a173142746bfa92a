"""Gossip (decentralized) SGD: topologies, their mixing matrix and spectral gap, neighbour averaging, D-PSGD.

Taught in notebooks/11_decentralized_training.ipynb (written there cell by cell first; this is the reference).
A topology says whom each rank talks to; its mixing matrix W says how much of each neighbour's model a rank keeps:
after one gossip round rank i holds sum_j W[i, j] x_j. Every W here is doubly stochastic (rows and columns sum to
1), so a round never moves the average of the models, only pulls the models towards it. How fast is set by
rho = ||W - 11^T/p||_2: the distance to the average shrinks at least by rho per round, and 1 - rho is the spectral
gap. Every W here is normal (circulant, or symmetric for the torus), so rho is also the largest |eigenvalue| of W
once the average's 1 is set aside; for a non-normal W the 2-norm can be larger, and it is the 2-norm that bounds one
round. A time-varying graph (the one-peer exponential graph) is judged by the product of its rounds' matrices.
Topologies: ring (2 neighbours), 2-D torus (4), static exponential graph (rank i sends to i + 2^k, k = 0..tau-1,
tau = ceil(log2 p)) and its one-peer version (round t: only i + 2^(t mod tau)), both from Ying et al., "Exponential
Graph is Provably Efficient for Decentralized Deep Training", NeurIPS 2021; complete (everyone, weight 1/p).
D-PSGD: Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017, written in
the order of Koloskova et al., ICML 2020 (Algorithm 1): a local SGD step, then one gossip round.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from ..collectives.p2p import post_together
from ..measure.emulated_link import emulate
from ..measure.traffic import Meter, metered
from . import tolerance
from .data import load_digits, worker_batch
from .model import flat_grads, flat_params, make_mlp, set_flat_params
from .straggler import Straggler
from .threads import single_threaded
from .worker_loop import forward_backward, simulate_workers, worker_steps

TOPOLOGIES = ("ring", "torus", "exponential", "one-peer exponential", "complete")


def torus_shape(p: int) -> tuple[int, int]:
    """Rows and columns of the 2-D torus on p ranks: the two factors of p closest to sqrt(p) (rows <= columns)."""
    r = math.isqrt(p)
    while p % r:
        r -= 1
    return r, p // r


def tau(p: int) -> int:
    """Hops of the exponential graph: the number of powers of two below p, ceil(log2 p)."""
    return (p - 1).bit_length()


def _offsets(topology: str, p: int, step: int) -> list[int]:
    """Every topology but the torus is circulant: rank i sends to i + o (mod p) for each offset o."""
    if topology == "ring":
        return [1, p - 1]
    if topology == "exponential":
        return [2 ** k for k in range(tau(p))]
    if topology == "one-peer exponential":
        return [2 ** (step % tau(p))]
    return list(range(1, p))   # complete


def out_neighbours(topology: str, p: int, rank: int, step: int = 0) -> list[int]:
    """The distinct ranks `rank` sends its model to in round `step` (never itself)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; one of {TOPOLOGIES}")
    if p == 1:
        return []
    if topology == "torus":
        rows, cols = torus_shape(p)
        r, c = divmod(rank, cols)
        peers = [r * cols + (c + 1) % cols, r * cols + (c - 1) % cols,
                 ((r + 1) % rows) * cols + c, ((r - 1) % rows) * cols + c]
    else:
        peers = [(rank + o) % p for o in _offsets(topology, p, step)]
    return sorted({q for q in peers if q != rank})


def in_neighbours(topology: str, p: int, rank: int, step: int = 0) -> list[int]:
    """The distinct ranks whose model `rank` receives in round `step` (the torus is symmetric: its out-neighbours)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; one of {TOPOLOGIES}")
    if p == 1:
        return []
    if topology == "torus":
        return out_neighbours(topology, p, rank, step)
    return sorted({(rank - o) % p for o in _offsets(topology, p, step)} - {rank})


def mixing_matrix(topology: str, p: int, step: int = 0) -> torch.Tensor:
    """W (float64, p x p): rank i keeps an equal share 1/(d+1) of itself and of each of its d in-neighbours."""
    w = torch.zeros(p, p, dtype=torch.float64)
    for i in range(p):
        srcs = in_neighbours(topology, p, i, step)
        w[i, i] = 1.0 / (len(srcs) + 1)
        w[i, srcs] = 1.0 / (len(srcs) + 1)
    return w


def rho(w: torch.Tensor) -> float:
    """||W - 11^T/p||_2: how much one round shrinks the worst distance to the average (1 = never converges)."""
    p = w.shape[0]
    return torch.linalg.matrix_norm(w - torch.full_like(w, 1.0 / p), ord=2).item()


def spectral_gap(w: torch.Tensor) -> float:
    """1 - rho(W): 0 for a graph whose models never agree, 1 for the complete graph (one round = exact average)."""
    return 1.0 - rho(w)


def steady_spread(w: torch.Tensor) -> float:
    """D-PSGD's consensus distance once it settles, in units of the noise one step adds per rank: X <- W(X - lr G)
    with gradient noise independent across ranks and steps keeps, in each eigen-direction k of W (normal W: an
    orthonormal eigenbasis, the average's direction k = 0 left out), |l_k|^2 / (1 - |l_k|^2) times that noise; the
    mean over ranks is (1/p) sum_k of it. The slowest direction (|l| = rho) dominates: about 1/(2 gap) for a small
    gap. math.inf for a graph that never agrees."""
    p = w.shape[0]
    mags = torch.linalg.eigvals(w - torch.full_like(w, 1.0 / p)).abs().square()
    if mags.max().item() >= 1 - 1e-12:
        return math.inf
    return (mags / (1 - mags)).sum().item() / p


def mean_atol(terms: int, size: float, dtype: torch.dtype = torch.float32) -> float:
    """Two float means of the same `terms` numbers, each at most `size`, summed in other orders: the sums differ by
    tolerance.sum_atol (Higham 2002), divided by `terms`, plus each division's rounding. A mean with positive weights
    summing to 1 (a gossip round, an all-reduce average) never amplifies a difference its inputs already had."""
    return tolerance.sum_atol(terms, terms * size, dtype) / terms + 2 * tolerance.unit_roundoff(dtype) * size


def averaged_sgd_atol(steps: int, lr: float, batch: int, width: int, terms: int,
                      dtype: torch.dtype = torch.float32) -> float:
    """How far two runs of `steps` SGD steps, each followed by a mean of `terms` models (a gossip round of d + 1
    models; local SGD's or data parallel's average of p), may end apart through rounding: tolerance.sgd_atol (the
    gradient over `batch` samples through layers `width` wide, and w - lr·g) plus one mean_atol of weights below
    tolerance.WEIGHT per step."""
    return tolerance.sgd_atol(steps, lr, batch, width, dtype) + steps * mean_atol(terms, tolerance.WEIGHT, dtype)


def rounds_to_consensus(w: torch.Tensor, eps: float) -> float:
    """The fewest rounds t with rho^t <= eps: the consensus distance Xi is then at most eps times Xi_0, one rank's
    distance at most eps sqrt(p) Xi_0 (math.inf when rho >= 1: a disconnected or periodic graph never agrees)."""
    r = rho(w)
    if r >= 1 - 1e-12:
        return math.inf
    if r <= 0 or eps >= 1:
        return 0 if eps >= 1 else 1
    t = max(0, math.ceil(math.log(eps) / math.log(r)))
    while r ** t > eps:          # the logarithms are rounded: settle the last step by the definition itself
        t += 1
    while t > 0 and r ** (t - 1) <= eps:
        t -= 1
    return t


def gossip_round(x: torch.Tensor, topology: str, step: int = 0) -> torch.Tensor:
    """One gossip round in place: send x to every out-neighbour, receive each in-neighbour's x (one
    dist.batch_isend_irecv: posted one by one, irecv before isend on every rank deadlocks on NCCL), then
    x <- (x + sum of received) / (d + 1)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    dsts, srcs = out_neighbours(topology, p, rank, step), in_neighbours(topology, p, rank, step)
    inbox = [torch.empty_like(x) for _ in srcs]
    reqs = post_together([(x, dst) for dst in dsts], list(zip(inbox, srcs)))
    for r in reqs:
        r.wait()
    for buf in inbox:
        x += buf
    x /= len(srcs) + 1
    return x


def consensus_distance(x: torch.Tensor) -> float:
    """(1/p) sum_i ||x_i - mean||^2 over the ranks (Kong et al., ICML 2021). A measurement, not part of training:
    it uses dist.all_reduce, which the byte meter and the link emulation (point-to-point only) do not see."""
    p = dist.get_world_size()
    mean = x.detach().clone()
    dist.all_reduce(mean)
    mean /= p
    sq = ((x.detach().double() - mean.double()) ** 2).sum().reshape(1)   # float64: the spread may be tiny
    dist.all_reduce(sq)
    return sq.item() / p


@functools.cache
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """data.load_digits() parsed once per process: parsing the CSV costs about 0.3 s on a small loaded CPU, and the
    trainers here (and their evaluations) would otherwise pay it every time. Callers only read the tensors."""
    return load_digits()


def evaluate(model: nn.Module) -> tuple[float, float]:
    """Loss and accuracy of a model on all 1797 digits (the set every rank trains on, shard by shard)."""
    x, y = digits()
    q = next(model.parameters())
    with torch.no_grad():
        out = model(x.to(q.device, q.dtype))
        return nn.functional.cross_entropy(out, y.to(q.device)).item(), (out.argmax(1).cpu() == y).float().mean().item()


def dpsgd_train(topology: str = "ring", steps: int = 20, batch_size: int = 32, lr: float = 0.1, hidden: int = 256,
                seed: int = 0, link=None, measure_consensus: bool = True, straggler=None) -> dict:
    """Run on every rank: decentralized SGD, a local SGD step on this rank's shard, then one gossip round.

    Returns this rank's final flat parameters, per-step losses, seconds, bytes (sent, received), the consensus
    distance after each step (measure_consensus: one extra all-reduce per step, outside the meter and the link, so
    leave it off when timing), the final loss and accuracy on all digits, and compute seconds per step.
    `straggler`: (rank, factor[, compute_s]) for straggler.Straggler: that rank computes factor times as long.
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    model = make_mlp(hidden, seed).to(device())
    slow = Straggler(model, *(straggler or (-1, 1.0)))

    def sgd_then_gossip(step: int):
        flat = flat_params(model) - lr * flat_grads(model)     # the local SGD step
        gossip_round(flat, topology, step)                     # then average with the neighbours
        set_flat_params(model, flat)

    consensus = []

    def measure(step: int, seconds: float):     # after the step is timed: a measurement, not part of training
        consensus.append(consensus_distance(flat_params(model)))

    (x, y), meter = digits(), Meter()
    with emulate(link), metered(meter):
        losses, step_s = worker_steps(steps, lambda step: worker_batch(x, y, rank, p, batch_size, step, seed),
                                      lambda xb, yb: forward_backward(model, xb, yb), sgd_then_gossip, meter,
                                      after_step=measure if measure_consensus else None)
    final_loss, acc = evaluate(model)
    flat = flat_params(model)
    return {"params": flat.cpu(), "losses": losses, "step_s": step_s, "traffic": meter.steps,
            "consensus": consensus, "final_loss": final_loss, "accuracy": acc, "compute_s": slow.compute_s,
            "model_bytes": flat.numel() * flat.element_size()}


@single_threaded
def simulate(topology: str, n_workers: int, steps: int, batch_size: int = 32, lr: float = 0.1, hidden: int = 256,
             seed: int = 0) -> torch.Tensor:
    """One process playing n workers of dpsgd_train: X <- W (X - lr G) with every worker's model a row of X.
    Returns the (n_workers, parameters) float32 matrix every rank's final weights must match row by row."""
    model = make_mlp(hidden, seed)
    rows = flat_params(model).repeat(n_workers, 1)

    def load(w: int) -> nn.Module:
        set_flat_params(model, rows[w].clone())
        return model

    def sgd(step: int, w: int, mdl: nn.Module):
        rows[w] -= lr * flat_grads(mdl)

    def mix(step: int):
        rows.copy_((mixing_matrix(topology, n_workers, step) @ rows.double()).float())

    simulate_workers(load, n_workers, steps, batch_size, seed, digits(), sgd, mix)
    return rows
