"""Mixture of experts: top-k gating with a capacity factor, the single-process layer that expert parallelism must equal.

Taught in notebooks/15_expert_parallel_and_mesh.ipynb. Sparsely-gated MoE (Shazeer et al., ICLR 2017); top-2
gating whose two weights are renormalised, and a capacity per expert for each group of tokens, first choices served
before second choices (GShard, Lepikhin et al. 2020, section 2.2 and algorithm 1, without its random dispatch of
second choices, so that the expert-parallel run can be compared exactly); top-1 gating weighted by the
router probability, capacity = capacity_factor x tokens x k / experts, tokens over capacity dropped (their MoE output
is zero and the residual connection carries them on), and the auxiliary load-balancing loss
alpha x E x sum_i f_i P_i (Switch Transformer, Fedus et al., JMLR 2022 / arXiv:2101.03961, section 2.2, eq. 4-6).
A "group" is one rank's tokens: each rank applies the capacity to its own tokens, as GShard and Switch do per core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


def capacity(tokens: int, n_experts: int, k: int, capacity_factor: float) -> int:
    """Assignments one expert accepts from one group: ceil(capacity_factor x tokens x k / experts)."""
    return math.ceil(capacity_factor * tokens * k / n_experts)


@dataclass
class Routing:
    """Where one group's tokens go. token/expert/weight: the KEPT assignments in priority order (first choices in
    token order, then second choices); dropped: assignments over capacity; probs: the router's softmax (T x E)."""

    token: torch.Tensor
    expert: torch.Tensor
    weight: torch.Tensor
    dropped: int
    probs: torch.Tensor
    capacity: int


def route(logits: torch.Tensor, k: int, capacity_factor: float | None) -> Routing:
    """Top-k routing of one group (T x E logits); capacity_factor None keeps every assignment (no dropping)."""
    t, e = logits.shape
    probs = logits.softmax(dim=-1)
    top_p, top_e = probs.topk(k, dim=-1)                               # T x k, best first
    weight = top_p if k == 1 else top_p / top_p.sum(-1, keepdim=True)  # Switch: p itself; GShard: renormalised
    expert = top_e.T.reshape(-1)                                       # choice-major: all first choices first
    token = torch.arange(t, device=logits.device).repeat(k)
    weight = weight.T.reshape(-1)
    if capacity_factor is None:                                        # nothing to drop
        return Routing(token, expert, weight, 0, probs, t * k)
    cap = capacity(t, e, k, capacity_factor)
    onehot = nn.functional.one_hot(expert, e)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1                 # how many went to this expert before
    keep = position < cap
    return Routing(token[keep], expert[keep], weight[keep], int((~keep).sum()), probs, cap)


def aux_loss(probs: torch.Tensor, top1: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss without alpha: E x sum_i f_i P_i (f_i: share of tokens whose first
    choice is i, not differentiable; P_i: mean router probability of i). Equals 1 when both are uniform."""
    e = probs.shape[-1]
    f = torch.bincount(top1, minlength=e).to(probs.dtype) / top1.numel()
    return e * (f * probs.mean(0)).sum()


def expert_mlp(d: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))


class MoE(nn.Module):
    """A gate (Linear d -> E, no bias) and E expert MLPs (d -> hidden -> d); forward applies it to ONE group."""

    def __init__(self, d: int = 8, hidden: int = 16, n_experts: int = 4, k: int = 1,
                 capacity_factor: float | None = 1.25, seed: int = 0, dtype: torch.dtype = torch.float64):
        super().__init__()
        if k not in (1, 2) or k > n_experts:
            raise ValueError(f"k is the experts per token, 1 (Switch) or 2 (GShard), at most n_experts; got {k}")
        # The same seed on every rank gives the same full layer everywhere; fork_rng keeps the caller's random
        # stream as it was (seeding the global generator here would change every later torch.randn of the caller).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.gate = nn.Linear(d, n_experts, bias=False)
            self.experts = nn.ModuleList(expert_mlp(d, hidden) for _ in range(n_experts))
        self.k, self.capacity_factor, self.n_experts = k, capacity_factor, n_experts
        self.to(dtype)

    def route(self, x: torch.Tensor) -> Routing:
        return route(self.gate(x), self.k, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.route(x)
        order = r.expert.argsort(stable=True)               # kept assignments grouped by expert, as dispatch sends them
        rows = x[r.token[order]].split(torch.bincount(r.expert, minlength=self.n_experts).tolist())
        # each expert on all its rows at once; one that got none still runs (on 0 rows): a zero gradient, not None
        out = torch.cat([expert(part) for expert, part in zip(self.experts, rows)])
        # gate-weighted and added at each token's position: top-k's contributions summed in expert order
        return torch.zeros_like(x).index_add_(0, r.token[order], r.weight[order, None] * out)


def experts_of(rank: int, n_experts: int, p: int) -> range:
    """Experts a rank holds under expert parallelism: a contiguous block of n_experts / p."""
    if n_experts % p:
        raise ValueError(f"expert parallelism puts n_experts / p experts on each rank; {n_experts} experts do not "
                         f"split over {p} ranks: choose a number of experts that {p} divides.")
    per = n_experts // p
    return range(rank * per, (rank + 1) * per)


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None) -> torch.Tensor:
    """all_to_all_single of rows: in_splits[j] rows to rank j, out_splits[j] rows from rank j (autograd stops here)."""
    out = rows.new_empty(sum(out_splits), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out


def ep_forward(x: torch.Tensor, layer: MoE, exchange=None, group=None) -> torch.Tensor:
    """Expert-parallel MoE (the library copy of notebook 15's cell): this rank's tokens x go to the rank holding
    their expert with all_to_all_single (counts first, then tokens), come back the same way, and are combined.
    `group`: the expert-parallel ranks (default: all of them); the experts are spread over this group only.
    `exchange(rows, out_splits, in_splits)` moves the rows within it (default: all_to_all_single, which autograd
    stops at; a differentiable exchange, such as exercise 15.2's, to train the experts)."""
    move = exchange or (lambda rows, out_splits, in_splits: _exchange(rows, out_splits, in_splits, group))
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    mine = experts_of(rank, layer.n_experts, p)
    r = layer.route(x)
    order = r.expert.argsort(stable=True)                       # group the assignments by expert, hence by rank
    send = x[r.token[order]]
    per_expert = torch.bincount(r.expert, minlength=layer.n_experts)
    from_each = torch.empty_like(per_expert)
    dist.all_to_all_single(from_each, per_expert, group=group)  # entry (j, e): rows rank j sends to my expert e
    send_splits = per_expert.view(p, -1).sum(1).tolist()
    recv_splits = from_each.view(p, -1).sum(1).tolist()
    recv = move(send, recv_splits, send_splits)                 # dispatch
    out = torch.zeros_like(recv)
    local = torch.arange(len(mine), device=x.device).repeat(p)          # received rows: by source, then by expert
    which = local.repeat_interleave(from_each)                           # my local expert of every received row
    for i, e in enumerate(mine):
        out[which == i] = layer.experts[e](recv[which == i])
    back = move(out, send_splits, recv_splits)                  # combine: the same exchange in reverse
    y = torch.zeros_like(x)
    y.index_add_(0, r.token[order], r.weight[order, None] * back)
    return y


def ep_bytes_formula(routings: list[Routing], n_experts: int, d: int, elem: int) -> list[dict]:
    """Bytes each rank sends to OTHER ranks in one expert-parallel forward, from the single-process routing of every
    group: its kept rows for experts elsewhere (dispatch), the rows others sent to its experts (combine), and the
    count exchange ((p-1) x E/p int64 entries)."""
    p = len(routings)
    per = n_experts // p
    dest = [r.expert // per for r in routings]
    out = []
    for rank in range(p):
        dispatch = int((dest[rank] != rank).sum()) * d * elem
        combine = sum(int((dest[j] == rank).sum()) for j in range(p) if j != rank) * d * elem
        out.append({"counts": (p - 1) * per * 8, "dispatch": dispatch, "combine": combine,
                    "total": (p - 1) * per * 8 + dispatch + combine})
    return out


def train_router(alpha: float, steps: int = 120, n_experts: int = 8, d: int = 16, batch: int = 256,
                 seed: int = 0, lr: float = 5e-3) -> dict:
    """Train a top-1 MoE (no dropping) on a regression task for `steps` Adam steps with loss = MSE + alpha x aux;
    returns the share of held-out tokens whose first choice is each expert, before and after, and the task loss.
    The inputs have a non-zero mean, so the untrained router already prefers some experts (as real embeddings do)."""
    layer = MoE(d, 32, n_experts, k=1, capacity_factor=None, seed=seed, dtype=torch.float32)
    g = torch.Generator().manual_seed(123)
    mu = torch.randn(d, generator=g)
    target = torch.randn(d, d, generator=g) / d ** 0.5

    def data(n):
        x = mu + torch.randn(n, d, generator=g)
        return x, torch.tanh(x @ target)

    def load(x):
        with torch.no_grad():
            return (torch.bincount(layer.gate(x).argmax(-1), minlength=n_experts) / len(x)).tolist()

    held_out, _ = data(4096)
    before = load(held_out)
    opt = torch.optim.Adam(layer.parameters(), lr=lr, foreach=True)   # one call per step for all tensors: faster
    threads = torch.get_num_threads()
    torch.set_num_threads(1)               # matrices this small only lose time to threads waiting on each other
    try:
        for _ in range(steps):
            x, y = data(batch)
            r = layer.route(x)
            task = ((layer(x) - y) ** 2).mean()
            loss = task + alpha * aux_loss(r.probs, r.probs.argmax(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return {"before": before, "after": load(held_out), "task_loss": task.item(), "alpha": alpha}
