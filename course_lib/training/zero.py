"""ZeRO stages 0-3 built from reduce-scatter and all-gather, with Adam by hand (notebook 12).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC'20, section 5:
stage 1 shards the optimizer state (P_os), stage 2 also the gradients (P_os+g), stage 3 also the parameters
(P_os+g+p); stage 0 here is plain data parallel with Adam. Every parameter is sharded on its own by rows (dim 0),
the rows padded to a multiple of p, rank r owning rows [r·k, (r+1)·k) with k = ceil(rows/p): FSDP2's layout
(Zhao et al. 2023, "PyTorch FSDP", and torch.distributed.fsdp.fully_shard), so hand-made stage 3 and FSDP2 hold
and send the same bytes. Every stage ends with the weights of single-process Adam (adam.train_single_adam).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from ..measure.memory import SCHEMES, numel, padded_numel, padded_rows, per_rank_bytes
from ..runtime.launch import run
from .adam import adam_step
from .fsdp import fsdp_train
from .model import flat_params, make_mlp
from .sharded_loop import train_steps

STAGES = (0, 1, 2, 3)
GATHERED = {"now": 0, "peak": 0}   # bytes of full parameters gathered by stage 3 and not yet dropped, this rank


# ---------------------------------------------------------------------------------------------- shards by rows
def pad(t: torch.Tensor, p: int) -> torch.Tensor:
    """A copy of t with zero rows appended up to a multiple of p rows (what reduce-scatter and all-gather need)."""
    out = t.new_zeros((padded_rows(t.shape[0], p),) + tuple(t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def my_rows(t: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of t: rows [rank·k, (rank+1)·k) of the padded t, k = ceil(rows/p), as its own tensor."""
    k = padded_rows(t.shape[0], p) // p
    return pad(t, p)[rank * k:(rank + 1) * k].clone()


def gather(shard: torch.Tensor, rows: int) -> torch.Tensor:
    """All-gather every rank's shard into the full padded tensor and return its first `rows` rows."""
    p = dist.get_world_size()
    full = shard.new_empty((p * shard.shape[0],) + tuple(shard.shape[1:]))
    dist.all_gather_single(full, shard.contiguous())
    return full[:rows]


def reduce_scatter_mean(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum `full` (padded) over ranks and keep only my rows, divided by p: my shard of the averaged gradient."""
    out = torch.empty_like(like)
    dist.reduce_scatter_single(out, pad(full, dist.get_world_size()))
    return out.div_(dist.get_world_size())


# ---------------------------------------------------------------------------------------------- stages 0-2
def dp_step(params, state, t, lr):
    """Stage 0 (plain data parallel): all-reduce every full gradient, full Adam on every rank."""
    for q, m, v in zip(params, state["m"], state["v"]):
        dist.all_reduce(q.grad)
        q.grad /= dist.get_world_size()
        adam_step(q, q.grad, m, v, t, lr)


def _update_my_rows_and_gather(params, grads, state, t, lr):
    """Adam on my rows of each parameter with my shard of m, v and the gradient, then all-gather the new rows."""
    rank, p = dist.get_rank(), dist.get_world_size()
    for q, g, m, v in zip(params, grads, state["m"], state["v"]):
        w = my_rows(q.detach(), p, rank)
        adam_step(w, g, m, v, t, lr)
        with torch.no_grad():
            q.copy_(gather(w, q.shape[0]))


def zero1_step(params, state, t, lr):
    """Stage 1 (ZeRO section 5.1): reduce-scatter each full gradient, Adam on my shard, all-gather the parameters."""
    grads = [reduce_scatter_mean(q.grad, m) for q, m in zip(params, state["m"])]
    _update_my_rows_and_gather(params, grads, state, t, lr)


def zero2_hooks(params, state):
    """Stage 2 (ZeRO section 5.2): reduce-scatter each gradient as soon as backward has produced it, keep only my
    shard (state["g"]) and free the full gradient: full gradients live only while backward is at their layer."""
    def reduce(q, i):
        state["g"][i] = reduce_scatter_mean(q.grad, state["m"][i])
        q.grad = None
    for i, q in enumerate(params):
        q.register_post_accumulate_grad_hook(lambda q, i=i: reduce(q, i))


def zero2_step(params, state, t, lr):
    """Stage 2 after backward: the gradient shards are ready; Adam on my shard, all-gather the parameters."""
    _update_my_rows_and_gather(params, state["g"], state, t, lr)


# ---------------------------------------------------------------------------------------------- stage 3
class GatherLinear(torch.autograd.Function):
    """y = x Wᵀ + b with W, b held as row shards: all-gather before use and drop after, in forward and again in
    backward, whose weight gradient is reduce-scattered back to shards (ZeRO section 5.3; the all-gather's dual)."""

    @staticmethod
    def forward(ctx, x, w_shard, b_shard, rows):
        w, b = gather(w_shard, rows), gather(b_shard, rows)
        _hold(w, b)
        ctx.save_for_backward(x, w_shard, b_shard)      # only shards are kept for backward, never w
        ctx.rows = rows
        out = x @ w.T + b
        _drop(w, b)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w_shard, b_shard = ctx.saved_tensors
        # the whole layer again, as FSDP re-gathers a unit (which of these backward needs: Exercise 12.3)
        w, b = gather(w_shard, ctx.rows), gather(b_shard, ctx.rows)
        _hold(w, b)
        grad_x = grad_out @ w if ctx.needs_input_grad[0] else None
        grad_w = reduce_scatter_mean(grad_out.T @ x, w_shard)
        grad_b = reduce_scatter_mean(grad_out.sum(0), b_shard)
        _drop(w, b)
        return grad_x, grad_w, grad_b, None


def _hold(*full):
    """Count gathered full tensors as alive (their padded storages' bytes) and keep the peak."""
    GATHERED["now"] += sum(t.untyped_storage().nbytes() for t in full)
    GATHERED["peak"] = max(GATHERED["peak"], GATHERED["now"])


def _drop(*full):
    """The gathered tensors are no longer referenced: they are freed when the call returns."""
    GATHERED["now"] -= sum(t.untyped_storage().nbytes() for t in full)


class ShardedLinear(nn.Module):
    """An nn.Linear whose weight and bias exist on this rank only as its row shards (parameters of shape
    (ceil(out/p), in) and (ceil(out/p),)); `fn` is the autograd.Function that gathers them."""

    def __init__(self, linear: nn.Linear, fn=GatherLinear):
        super().__init__()
        p, rank = dist.get_world_size(), dist.get_rank()
        self.rows, self.fn = linear.out_features, fn
        self.weight = nn.Parameter(my_rows(linear.weight.detach(), p, rank))
        self.bias = nn.Parameter(my_rows(linear.bias.detach(), p, rank))

    def forward(self, x):
        return self.fn.apply(x, self.weight, self.bias, self.rows)


def shard_model(model: nn.Sequential, fn=GatherLinear) -> nn.Sequential:
    """The same model with every nn.Linear replaced by a ShardedLinear (the full weights are then dropped)."""
    return nn.Sequential(*[ShardedLinear(m, fn) if isinstance(m, nn.Linear) else m for m in model])


def zero3_step(params, state, t, lr):
    """Stage 3: the gradients are already shards (reduce-scattered in backward); Adam on my shards, no communication."""
    for q, m, v in zip(params, state["m"], state["v"]):
        adam_step(q, q.grad, m, v, t, lr)


def full_params(model: nn.Module, sharded: bool) -> torch.Tensor:
    """All parameters as one flat CPU vector; a sharded model's shards are gathered first."""
    if not sharded:
        return flat_params(model).cpu()
    rows = [m.rows for m in model if isinstance(m, ShardedLinear) for _ in (0, 1)]
    return torch.cat([gather(q.detach(), r).reshape(-1) for q, r in zip(model.parameters(), rows)]).cpu()


# ---------------------------------------------------------------------------------------------- training
STEP_FNS = {0: dp_step, 1: zero1_step, 2: zero2_step, 3: zero3_step}


def zero_train(stage: int, steps: int = 5, batch_size: int = 32, lr: float = 1e-3, hidden: int = 256,
               seed: int = 0, step_fn=None, hooks_fn=zero2_hooks, linear_fn=GatherLinear,
               comm_log: bool = True, dtype: torch.dtype = torch.float32) -> dict:
    """Run on every rank: Adam data parallel at ZeRO `stage` (0 = plain DP). Returns the final full parameters, this
    rank's loss per step, its bytes by category measured at the end of the last backward (memory.measure), the peak
    bytes of gathered full parameters (stage 3), and a CommLog summary per step. `step_fn`, `hooks_fn` (stage 2)
    and `linear_fn` (stage 3) replace the library's parts (the notebook passes the ones written in its cells);
    comm_log=False skips the traffic count; dtype=torch.float64 trains in float64 (tolerance.py: the exact
    comparison with single-process Adam)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES} (0 = plain data parallel), got {stage!r}")
    rank, p = dist.get_rank(), dist.get_world_size()
    dev = device()
    model = make_mlp(hidden, seed, dtype).to(dev)               # same seed: same initial weights on every rank
    shapes = [tuple(q.shape) for q in model.parameters()]
    if stage == 3:
        model = shard_model(model, linear_fn)
    params = list(model.parameters())
    # Adam's m and v: full on stage 0, my rows only from stage 1 on (stage 3's parameters are already my rows)
    shard = (lambda q: q) if stage in (0, 3) else (lambda q: my_rows(q.detach(), p, rank))
    state = {"m": [torch.zeros_like(shard(q)) for q in params], "v": [torch.zeros_like(shard(q)) for q in params],
             "g": [None] * len(params)}
    if stage == 2:
        hooks_fn(params, state)
    step_fn = step_fn or STEP_FNS[stage]
    GATHERED.update(now=0, peak=0)
    losses, traffic, memory = train_steps(
        model, params, steps, batch_size, seed, comm_log,
        update=lambda t: step_fn(params, state, t, lr),
        grads=lambda: state["g"] if stage == 2 else [q.grad for q in params],
        optimizer_state=state["m"] + state["v"])
    return {"params": full_params(model, stage == 3), "losses": losses, "memory": memory,
            "gathered_peak": GATHERED["peak"], "traffic": traffic, "shapes": shapes}


# ---------------------------------------------------------------------------------------------- every scheme at once
def ring_bytes_formula(scheme: str, shapes, p: int, bytes_per_value: int = 4) -> float:
    """Bytes one rank sends per step under ring collectives (ZeRO paper, section 7): DP all-reduces the gradients,
    2(p-1)/p·Ψ values; ZeRO-1/2 reduce-scatter gradients and all-gather parameters, the same 2(p-1)/p·Ψ_pad;
    ZeRO-3/FSDP2 all-gather the parameters again in backward, 3(p-1)/p·Ψ_pad: 1.5x."""
    factor = {"DP": 2, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3, "FSDP2": 3}[scheme]
    values = numel(shapes) if scheme == "DP" else padded_numel(shapes, p)
    return factor * (p - 1) / p * values * bytes_per_value


def real_rows(rows: int, p: int, rank: int) -> int:
    """Rows of a `rows`-row tensor that rank `rank` really owns, padding excluded: ceil(rows/p) on the first ranks,
    what is left on the next, 0 after (10 rows at 4 ranks: 3, 3, 3, 1)."""
    k = padded_rows(rows, p) // p
    return max(0, min(k, rows - rank * k))


def held_by_fsdp2(shapes, p: int, rank: int) -> dict:
    """Bytes rank `rank` holds under FSDP2 with torch's Adam in fp32: parameters and gradients in FSDP2's padded
    shard storage (per_rank_bytes("FSDP2")), Adam's m and v made like the DTensor's local shard, its real rows only
    (8 bytes per value); the last ranks hold less when rows do not split evenly."""
    out = dict(per_rank_bytes("FSDP2", shapes, p))
    out["optimizer"] = 8 * sum(real_rows(s[0], p, rank) * numel([s[1:]]) for s in shapes)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def train_schemes(schemes=SCHEMES, float64_rerun: bool = False, **kw) -> dict | tuple[dict, dict]:
    """Run on every rank: each scheme in turn in the same rank processes ({scheme: result}); kw go to zero_train /
    fsdp.fsdp_train. float64_rerun: then every scheme again in float64 without the traffic count (the weights'
    comparison, tolerance.py), in the same processes rather than a second launch; returns both dicts."""
    out = {s: fsdp_train(**kw) if s == "FSDP2" else zero_train(SCHEMES.index(s), **kw) for s in schemes}
    if not float64_rerun:
        return out
    return out, train_schemes(schemes, **dict(kw, dtype=torch.float64, comm_log=False))


def run_schemes(world_size: int, schemes=SCHEMES, timeout: float = 120, float64_rerun: bool = False,
                **kw) -> dict | tuple[dict, dict]:
    """From the kernel: check the scheme names, then one launch of train_schemes; {scheme: [result of each rank]}
    (float64_rerun: a pair of them, the run as asked and its float64 rerun)."""
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise ValueError(f"unknown scheme(s) {bad}: choose from {SCHEMES}")
    res = run(train_schemes, world_size=world_size, args=(tuple(schemes), float64_rerun), kwargs=kw, output="none",
              timeout=timeout)
    per_scheme = [{s: [v[s] for v in values] for s in schemes}
                  for values in (zip(*res.values) if float64_rerun else [res.values])]
    return tuple(per_scheme) if float64_rerun else per_scheme[0]
