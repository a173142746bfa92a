"""Sending less: top-k sparsification with error feedback, and rank-r PowerSGD (notebook 11b).

Top-k with error feedback (Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018, Algorithm 1, one
worker's; here every rank keeps its own memory and the ranks average what they send): each rank adds lr * gradient
to its memory, sends only the k largest entries (values and their indices) and keeps the rest in memory for later
steps, so nothing is lost, only delayed. Sparse vectors cannot be summed chunk-wise by a ring all-reduce, so they
are all-gathered: (p-1) k (4 + 4) bytes sent per rank, growing with p.
PowerSGD (Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019, Algorithms 1-2): each weight matrix's gradient M (n x m, plus the error kept from the
last step) is replaced by a rank-r approximation from one step of power iteration, P = M Q, all-reduce P,
orthogonalize, Q = M^T P, all-reduce Q: r (n + m) numbers instead of n m. Q is reused from the last step (warm
start). Which tensors are compressed follows torch's DDP hook (ddp_comm_hooks.powerSGD_hook, min_compression_rate
2): a matrix only if 2 r (n + m) < n m; vectors (biases) are all-reduced as they are, in the same message as the Ps.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from ..collectives import chunk_bounds, ring_all_gather, ring_all_reduce
from ..measure.emulated_link import emulate
from ..measure.traffic import Meter, metered
from . import tolerance
from .data import worker_batch
from .gossip import digits, evaluate, mean_atol
from .model import flat_grads, flat_params, make_mlp, set_flat_params
from .straggler import Straggler
from .threads import single_threaded
from .worker_loop import forward_backward, sgd_, simulate_workers, worker_steps

MIN_COMPRESSION_RATE = 2     # torch's PowerSGDState default


def ring_sent_bytes(numel: int, p: int, rank: int, elem_size: int = 4) -> int:
    """Exact bytes `rank` sends in the course's ring all-reduce of numel elements: reduce-scatter sends every chunk
    but its own (n - |c_r|), all-gather every chunk but its right neighbour's (n - |c_r+1|) (collectives/ring.py)."""
    if p == 1:
        return 0
    sizes = [hi - lo for lo, hi in chunk_bounds(numel, p)]
    return (2 * numel - sizes[rank] - sizes[(rank + 1) % p]) * elem_size


def topk_sent_bytes(k: int, p: int) -> int:
    """Bytes a rank sends per step in the ring all-gathers of k float32 values and k int32 indices: (p-1) k 8."""
    return (p - 1) * k * (4 + 4)


def compressed(shape, r: int) -> bool:
    """Does PowerSGD compress a tensor of this shape? Only matrices worth it: 2 r (n + m) < n m (torch's rule)."""
    if len(shape) < 2:
        return False
    n, m = shape[0], int(torch.tensor(shape[1:]).prod())
    rr = min(n, m, r)
    return rr * (n + m) * MIN_COMPRESSION_RATE < n * m


def powersgd_sizes(shapes, r: int) -> tuple[int, int]:
    """Elements of the two all-reduces per step: (Ps of the compressed matrices + every uncompressed tensor, Qs)."""
    first = second = 0
    for s in shapes:
        n, m = s[0], int(torch.tensor(s[1:]).prod()) if len(s) > 1 else 1
        if compressed(s, r):
            first += n * min(n, m, r)
            second += m * min(n, m, r)
        else:
            first += n * m
    return first, second


def orthogonalize(p_mat: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning the columns of P (reduced QR). Only the span matters: P P^T is the same."""
    return torch.linalg.qr(p_mat).Q


class PowerSGD:
    """Rank-r PowerSGD state of one rank: a warm-start Q and an error (feedback) buffer per compressed matrix."""

    def __init__(self, params, r: int = 2, seed: int = 0):
        self.r, self.params = r, list(params)
        gen = torch.Generator().manual_seed(seed)   # the same Q on every rank: P = M Q must add up across ranks
        self.q, self.error = {}, {}
        for i, w in enumerate(self.params):
            if compressed(w.shape, r):
                n, m = w.shape[0], w[0].numel()
                self.q[i] = orthogonalize(torch.randn(m, min(n, m, r), generator=gen)).to(w.device, w.dtype)
                self.error[i] = torch.zeros(n, m, device=w.device, dtype=w.dtype)

    def all_reduce_(self, grads: list, all_reduce=ring_all_reduce) -> None:
        """Replace every gradient by its compressed average over ranks, in place, with two all-reduces."""
        p = dist.get_world_size()
        mats = {i: grads[i].reshape(grads[i].shape[0], -1) + self.error[i] for i in self.q}     # M = g + error
        ps = {i: mats[i] @ self.q[i] for i in self.q}
        plain = [i for i in range(len(grads)) if i not in self.q]
        first = torch.cat([ps[i].reshape(-1) for i in self.q] + [grads[i].reshape(-1) for i in plain])
        all_reduce(first)                                   # sum of the Ps, and of the uncompressed tensors
        off = 0
        for i in self.q:
            ps[i] = orthogonalize(first[off:off + ps[i].numel()].view_as(ps[i]))
            off += ps[i].numel()
        for i in plain:
            grads[i].copy_(first[off:off + grads[i].numel()].view_as(grads[i]) / p)
            off += grads[i].numel()
        second = torch.cat([(mats[i].T @ ps[i]).reshape(-1) for i in self.q])
        all_reduce(second)                                  # sum of the Qs
        off = 0
        for i in self.q:
            self.q[i] = second[off:off + self.q[i].numel()].view_as(self.q[i]) / p
            off += self.q[i].numel()
            approx = ps[i] @ self.q[i].T                    # the same rank-r average on every rank
            self.error[i] = mats[i] - approx                # what this rank's gradient lost, sent next time
            grads[i].copy_(approx.view_as(grads[i]))


def compressed_train(method: str = "powersgd", steps: int = 20, batch_size: int = 32, lr: float = 0.1,
                     hidden: int = 256, seed: int = 0, rank_r: int = 2, k_fraction: float = 0.01, link=None,
                     straggler=None, dtype: torch.dtype = torch.float32) -> dict:
    """Run on every rank: SGD whose gradients travel compressed, method "powersgd" (rank rank_r) or "topk" (the k =
    k_fraction of all entries with the largest magnitude, error feedback), over the course's ring collectives.

    dtype=torch.float64 for the comparison with simulate_powersgd (powersgd_atol: float32 cannot decide it).
    Returns final flat parameters, per-step losses, seconds, bytes (sent, received), compute seconds, the final
    loss and accuracy on all digits.
    """
    if method not in ("powersgd", "topk"):
        raise ValueError(f"method must be 'powersgd' or 'topk', got {method!r}")
    rank, p = dist.get_rank(), dist.get_world_size()
    model = make_mlp(hidden, seed, dtype).to(device())
    slow = Straggler(model, *(straggler or (-1, 1.0)))
    params = list(model.parameters())
    state = PowerSGD(params, rank_r, seed) if method == "powersgd" else None
    numel = sum(q.numel() for q in params)
    k = max(1, int(k_fraction * numel))
    memory = torch.zeros(numel, device=device(), dtype=dtype)

    def powersgd_step(step: int):
        grads = [q.grad for q in params]
        state.all_reduce_(grads)
        sgd_(params, lr, grads)

    def topk_step(step: int):
        memory.add_(lr * flat_grads(model))                   # error feedback: what was not sent yet
        idx = memory.abs().topk(k).indices
        vals = memory[idx]
        memory[idx] = 0                                       # those k leave the memory now
        all_vals, all_idx = ring_all_gather(vals), ring_all_gather(idx.to(torch.int32))
        update = torch.zeros_like(memory).index_add_(0, all_idx.long(), all_vals) / p
        set_flat_params(model, flat_params(model) - update)

    (x, y), meter = digits(), Meter()
    with emulate(link), metered(meter):
        losses, step_s = worker_steps(steps, lambda step: worker_batch(x, y, rank, p, batch_size, step, seed),
                                      lambda xb, yb: forward_backward(model, xb, yb),
                                      topk_step if state is None else powersgd_step, meter)
    final_loss, acc = evaluate(model)
    return {"params": flat_params(model).cpu(), "losses": losses, "step_s": step_s, "traffic": meter.steps,
            "compute_s": slow.compute_s, "final_loss": final_loss, "accuracy": acc, "k": k,
            "shapes": [tuple(q.shape) for q in params], "model_bytes": numel * params[0].element_size()}


@single_threaded
def simulate_powersgd(n_workers: int, steps: int, batch_size: int = 32, lr: float = 0.1, hidden: int = 256,
                      seed: int = 0, r: int = 2, dtype: torch.dtype = torch.float32, record: list | None = None
                      ) -> torch.Tensor:
    """One process computing what n ranks of compressed_train("powersgd") compute (sums over workers instead of
    all-reduces): the weights every rank must end with. `record`, when a list, gets per step (the largest
    amplification A = ||M||_F ||Q||_2 / sigma_r(M Q) of any compressed matrix M (the workers' mean), the largest
    |entry| of any M): what powersgd_atol needs."""
    x, y = digits()
    model = make_mlp(hidden, seed, dtype)
    params = list(model.parameters())
    states = [PowerSGD(params, r, seed) for _ in range(n_workers)]
    ref = states[0]
    grads = []

    def keep_grads(step: int, w: int, mdl: nn.Module):
        grads.append([q.grad.clone() for q in params])

    def compress_and_step(step: int):
        new, amp, big = [], 0.0, 0.0
        for i, q in enumerate(params):
            if i not in ref.q:
                new.append(sum(g[i] for g in grads) / n_workers)
                continue
            mats = [g[i].reshape(q.shape[0], -1) + s.error[i] for g, s in zip(grads, states)]
            if record is not None:
                mean = sum(mats) / n_workers
                sigma = torch.linalg.svdvals(mean @ ref.q[i])[-1].item()
                amp = max(amp, mean.norm().item() * torch.linalg.matrix_norm(ref.q[i], 2).item() / sigma
                          if sigma > 0 else math.inf)
                big = max(big, max(mt.abs().max().item() for mt in mats))
            pm = orthogonalize(sum(mt @ ref.q[i] for mt in mats))
            qm = sum(mt.T @ pm for mt in mats) / n_workers
            approx = pm @ qm.T
            for s, mt in zip(states, mats):
                s.q[i], s.error[i] = qm, mt - approx
            new.append(approx.view_as(q))
        if record is not None:
            record.append((amp, big))
        sgd_(params, lr, new)
        grads.clear()

    simulate_workers(lambda w: model, n_workers, steps, batch_size, seed, (x.to(dtype), y), keep_grads,
                     compress_and_step)
    return flat_params(model)


def powersgd_atol(n_workers: int, steps: int, batch_size: int = 32, lr: float = 0.1, hidden: int = 256,
                  seed: int = 0, r: int = 2, dtype: torch.dtype = torch.float64) -> float:
    """How far compressed_train("powersgd") may end from simulate_powersgd through rounding alone, to first order.

    Per compressed n x m matrix, in Frobenius norm: each step's input M = gradient + error differs by what the
    error memory carried over plus b = sqrt(nm) (tolerance.grad_atol of the gradient + mean_atol of the mean over
    ranks + the rounding of the products M Q, M^T P, P Q^T, sums of at most max(n, m) + r terms below the largest
    entry). The rank-r result P P^T M moves by that times 1 + 2A: orthogonalizing P turns a change dP into a turn of
    its column space by at most ||dP|| / sigma_r(P) (Wedin's bound), doubled for the QR's own rounding and the
    warm-start Q's difference; A (measured, per step, by the simulation) is that amplification relative to M. Error
    feedback carries input and output differences into the next step, so the bound compounds: over 3 steps in float64
    it is ~1e-7, over 16 it says nothing; in float32 it says nothing after one step. Compare in float64 over a few
    steps."""
    record: list = []
    simulate_powersgd(n_workers, steps, batch_size, lr, hidden, seed, r, dtype, record)
    u = tolerance.unit_roundoff(dtype)
    shapes = [(s[0], math.prod(s[1:])) for s in (tuple(q.shape) for q in make_mlp(hidden).parameters())
              if compressed(s, r)]
    size, longest = max(n * m for n, m in shapes), max(max(n, m) for n, m in shapes)
    carry = total = 0.0   # the plainly averaged vectors differ by far less (mean_atol per step): inside the bound
    for amp, big in record:
        b = math.sqrt(size) * (tolerance.grad_atol(batch_size, hidden, dtype) + mean_atol(n_workers, big, dtype)
                               + 2 * (longest + r) * u * big)
        d = carry + b
        out = (1 + 2 * amp) * d
        total += lr * out + 2 * u * tolerance.WEIGHT       # and the rounding of w - lr g
        carry = d + out
    return total
