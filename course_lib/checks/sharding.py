"""Checkers for the exercises of notebook 12 (sharded data parallel: ZeRO and FSDP).

Each runs real ranks: the bytes a rank really holds under each ZeRO stage, and a ZeRO-1 update written by the
learner trained against single-process Adam (Rajbhandari et al., SC'20, section 5.1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..devices import device
from ..results import RankFailed
from ..training.adam import train_single_adam
from ..training.data import load_digits, worker_batch
from ..training.model import flat_params, make_mlp
from ..training.zero import run_schemes
from .core import ExerciseFailed

STEPS, BATCH, HIDDEN = 3, 16, 32     # hidden 32: 3466 parameters, a 10-row layer: uneven over 3 and 4 ranks


def _passed(exercise: str, what: str) -> None:
    print(f"PASS {exercise}: {what}")


def _unless_not_implemented(exercise, e: RankFailed, world, hint):
    if e.failure.etype == "NotImplementedError":      # a student copy: the exercise is not done yet
        raise NotImplementedError(f"{exercise}: {e.failure.message}") from None
    raise ExerciseFailed(f"{exercise}: rank {e.rank} failed with {world} ranks:\n{e}\nHint: {hint}") from None


def check_per_rank_bytes(per_rank_bytes, exercise: str = "Exercise 12.1 (bytes per rank)") -> None:
    """`per_rank_bytes(scheme, shapes, p)` -> {"params", "grads", "optimizer"}: bytes ONE rank holds under scheme
    "DP", "ZeRO-1", "ZeRO-2" or "ZeRO-3" (fp32 Adam); compared with what real ranks held, for 3 and 4 ranks."""
    hint = ("fp32 Adam: 4 B weights, 4 B gradients, 8 B optimizer state per parameter; a sharded tensor is split "
            "by rows, padded up to a multiple of p rows, so a rank holds ceil(rows/p) x (elements per row)")
    schemes = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
    for p in (3, 4):
        out = run_schemes(p, schemes, timeout=60, steps=1, batch_size=BATCH, hidden=HIDDEN, comm_log=False)
        for s in schemes:
            shapes = out[s][0]["shapes"]
            answer = per_rank_bytes(s, shapes, p)
            for r, v in enumerate(out[s]):
                held = {c: v["memory"][c] for c in ("params", "grads", "optimizer")}
                got = {c: answer.get(c) for c in held} if isinstance(answer, dict) else answer
                if got != held:
                    raise ExerciseFailed(f"{exercise}: {s} with p={p}, shapes {shapes}: you said {got}, rank {r} "
                                         f"really held {held} bytes.\nHint: {hint}")
    _passed(exercise, "your formula equals the bytes real ranks held under DP and ZeRO-1/2/3 at 3 and 4 ranks")


_COLLECTIVES = ("all_reduce", "reduce_scatter_single", "all_gather_single", "reduce_scatter_tensor",
                "all_gather_into_tensor", "all_gather", "reduce_scatter")


def _train_with_learner_step(step_fn):
    """Run on every rank: Adam data parallel where the learner's step_fn does the whole update with m, v shards
    of ceil(Ψ/p) values; returns (final flat params, calls per collective per step, shard sizes after)."""
    rank, p, dev = dist.get_rank(), dist.get_world_size(), device()
    model = make_mlp(HIDDEN, 0).to(dev)
    params = list(model.parameters())
    c = -(-sum(q.numel() for q in params) // p)
    m, v = torch.zeros(c, device=dev), torch.zeros(c, device=dev)
    x, y = load_digits()
    calls, saved = {}, {n: getattr(dist, n) for n in _COLLECTIVES}

    def counting(name):
        def call(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return saved[name](*a, **k)
        return call

    for name in _COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        for step in range(STEPS):
            xb, yb = worker_batch(x, y, rank, p, BATCH, step)
            model.zero_grad()
            nn.functional.cross_entropy(model(xb.to(dev)), yb.to(dev)).backward()
            step_fn(params, m, v, step + 1, 1e-3)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return flat_params(model).cpu(), {k: n / STEPS for k, n in calls.items()}, (m.numel(), v.numel())


def check_zero1_flat_step(step_fn, exercise: str = "Exercise 12.2 (a ZeRO-1 update in one flat buffer)") -> None:
    """`step_fn(params, m, v, t, lr)`: reduce-scatter all gradients in one flat buffer, Adam on this rank's slice
    with its shard m, v (ceil(Ψ/p) values each), all-gather the slices into the parameters. Trained on 2 and 3
    real ranks: weights must equal single-process Adam, with exactly one reduce-scatter and one all-gather a step."""
    from ..launch import run

    hint = ("flatten the gradients into p x len(m) values (zeros after Ψ), dist.reduce_scatter_single into len(m) "
            "values, divide by p; adam_step on your slice of the flat padded parameters; dist.all_gather_single "
            "the slices back and copy the first Ψ values into the parameters")
    for p in (2, 3):
        try:
            vals = run(_train_with_learner_step, world_size=p, args=(step_fn,), output="none", timeout=30).values
        except RankFailed as e:
            _unless_not_implemented(exercise, e, p, hint)
        ref, _ = train_single_adam(p, STEPS, BATCH, hidden=HIDDEN)
        for r, (params, calls, sizes) in enumerate(vals):
            if sizes != (vals[0][2][0],) * 2 or sizes[0] != -(-ref.numel() // p):
                raise ExerciseFailed(f"{exercise}: rank {r} of {p}: m and v must stay this rank's shards of "
                                     f"ceil(Ψ/p) = {-(-ref.numel() // p)} values, they have {sizes}.\nHint: {hint}")
            if calls.get("all_reduce"):
                raise ExerciseFailed(f"{exercise}: rank {r} called dist.all_reduce; ZeRO-1 replaces it by a "
                                     f"reduce-scatter and an all-gather.\nHint: {hint}")
            rs = calls.get("reduce_scatter_single", 0) + calls.get("reduce_scatter_tensor", 0)
            ag = calls.get("all_gather_single", 0) + calls.get("all_gather_into_tensor", 0)
            if (rs, ag) != (1, 1):
                raise ExerciseFailed(f"{exercise}: rank {r} made {calls} collective calls per step; one flat "
                                     f"buffer means one reduce-scatter and one all-gather.\nHint: {hint}")
            if not torch.allclose(params, ref, atol=1e-5):
                bad = (params - ref).abs().max().item()
                raise ExerciseFailed(f"{exercise}: with {p} ranks rank {r}'s weights differ from single-process "
                                     f"Adam by up to {bad:.3g}.\nHint: {hint}")
    _passed(exercise, "weights equal single-process Adam on 2 and 3 ranks with one reduce-scatter and one "
                      "all-gather per step")
