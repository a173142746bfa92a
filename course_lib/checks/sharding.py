"""Checkers for the exercises of notebook 12 (sharded data parallel: ZeRO and FSDP).

Each runs real ranks: the bytes a rank really holds under each ZeRO stage, and a ZeRO-1 update written by the
learner trained against single-process Adam (Rajbhandari et al., SC'20, section 5.1). The library's own answers
(course_lib.measure.memory's formulas, course_lib.training.zero's steps) are switched off while the learner's code
runs, and its collectives are counted at the dispatcher (traffic.py), however it called them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..measure.c10d_ops import everything_but
from ..runtime.devices import device
from ..training.adam import adam_step
from ..training.data import combined_batch, load_digits, worker_batch
from ..training.model import flat_params, make_mlp
from ..training.zero import run_schemes
from .core import ExerciseFailed, call_learner, launch_checked, passed, watched_call, with_hint

STEPS, BATCH, HIDDEN = 3, 16, 32     # hidden 32: 3466 parameters, a 10-row layer: uneven over 3 and 4 ranks
MEMORY_ANSWERS = tuple(f"course_lib.measure.memory.{f}" for f in ("per_rank_bytes", "pad_bytes", "padded_numel",
                                                                     "padded_rows"))
# the routes to bytes measured on real ranks: the library's ZeRO runs and the launcher itself
MEASURED_ANSWERS = ("course_lib.training.zero.run_schemes", "course_lib.training.zero.train_schemes",
                    "course_lib.runtime.launch.run")
ZERO_ANSWERS = tuple(f"course_lib.training.zero.{f}" for f in ("zero1_step", "zero2_step", "zero3_step", "dp_step",
                                                               "reduce_scatter_mean", "_update_my_rows_and_gather"))


def check_per_rank_bytes(per_rank_bytes, exercise: str = "Exercise 12.1") -> None:
    """`per_rank_bytes(scheme, shapes, p)` -> {"params", "grads", "optimizer"}: bytes ONE rank holds under scheme
    "DP", "ZeRO-1", "ZeRO-2" or "ZeRO-3" (fp32 Adam); compared with what real ranks held, for 3 and 4 ranks."""
    hint = ("Count bytes per parameter for weights, gradients and Adam's state in fp32, and how a tensor split by rows "
            "over p ranks rounds up. Which of the three does each ZeRO stage shard?")
    schemes = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
    shapes = [tuple(q.shape) for q in make_mlp(HIDDEN, 0).parameters()]
    # The learner's answers first (no ranks needed), then what real ranks held with the same model.
    answers = {(s, p): call_learner(exercise, per_rank_bytes, s, shapes, p, hint=hint,
                                    library=MEMORY_ANSWERS + MEASURED_ANSWERS,
                                    why="the bytes each ZeRO stage leaves on a rank")
               for p in (3, 4) for s in schemes}
    for p in (3, 4):
        out = run_schemes(p, schemes, timeout=60, steps=1, batch_size=BATCH, hidden=HIDDEN, comm_log=False)
        for s in schemes:
            assert [tuple(x) for x in out[s][0]["shapes"]] == shapes, "the ranks trained another model"
            answer = answers[(s, p)]
            for r, v in enumerate(out[s]):
                held = {c: v["memory"][c] for c in ("params", "grads", "optimizer")}
                got = {c: answer.get(c) for c in held} if isinstance(answer, dict) else answer
                if got != held:
                    raise ExerciseFailed(with_hint(f"{exercise}: {s} with p={p}, shapes {shapes}: you said {got}, "
                                                   f"rank {r} really held {held} bytes.", hint))
    return passed(exercise, "your formula equals the bytes real ranks held under DP and ZeRO-1/2/3 at 3 and 4 ranks")


WARM = 2    # steps of single-process Adam before the learner's: m and v start as shards of a state that is not zero


def _single_adam_state(p: int, steps: int):
    """Single-process Adam on the combined batch of p workers (as train_single_adam): flat params, m and v."""
    x, y = load_digits()
    model = make_mlp(HIDDEN, 0)
    params = list(model.parameters())
    m, v = [torch.zeros_like(q) for q in params], [torch.zeros_like(q) for q in params]
    for step in range(steps):
        xb, yb = combined_batch(x, y, p, BATCH, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        for q, mq, vq in zip(params, m, v):
            adam_step(q, q.grad, mq, vq, step + 1, 1e-3)
    flat = [torch.cat([t.detach().reshape(-1) for t in ts]) for ts in (params, m, v)]
    return flat[0], flat[1], flat[2]


def _shard(flat: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    """Rank's slice of `flat` padded with zeros to a multiple of p."""
    c = -(-flat.numel() // p)
    padded = torch.zeros(p * c, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return padded[rank * c:(rank + 1) * c].clone()


def _train_with_learner_step(exercise, step_fn):
    """Run on every rank: WARM steps of single-process Adam, then STEPS steps of data parallel where the learner's
    step_fn does the whole update with m, v shards of ceil(Ψ/p) values, handed over holding this rank's slice of the
    warm state; returns (final flat params, collectives per step, shard sizes after, m and v after, m and v before)."""
    rank, p, dev = dist.get_rank(), dist.get_world_size(), device()
    model = make_mlp(HIDDEN, 0).to(dev)
    params = list(model.parameters())
    warm, warm_m, warm_v = _single_adam_state(p, WARM)
    torch.nn.utils.vector_to_parameters(warm.to(dev), params)
    m, v = _shard(warm_m, p, rank).to(dev), _shard(warm_v, p, rank).to(dev)
    before = (m.cpu().clone(), v.cpu().clone())
    x, y = load_digits()
    calls = []
    for step in range(WARM, WARM + STEPS):
        xb, yb = worker_batch(x, y, rank, p, BATCH, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(xb.to(dev)), yb.to(dev)).backward()
        _, record = watched_call(exercise, step_fn, (params, m, v, step + 1, 1e-3), library=ZERO_ANSWERS,
                                 forbid=everything_but("reduce_scatter_single", "all_gather_single"),
                                 why="replacing all-reduce by one reduce-scatter and one all-gather of a flat buffer")
        calls.append(sorted(name for name, *_ in record["collectives"]))
    return flat_params(model).cpu(), calls, (m.numel(), v.numel()), (m.cpu(), v.cpu()), before


def check_zero1_flat_step(step_fn, exercise: str = "Exercise 12.2") -> None:
    """`step_fn(params, m, v, t, lr)`: reduce-scatter all gradients in one flat buffer, Adam on this rank's slice
    with its shard m, v (ceil(Ψ/p) values each), all-gather the slices into the parameters. Trained on 2 and 3
    real ranks from a warm start (m, v arrive holding this rank's slice of Adam's state after WARM steps, t > 1):
    weights must equal single-process Adam, with exactly one reduce-scatter and one all-gather a step, and m, v
    must end as this rank's slice of single-process Adam's state: an update that keeps a full state of its own
    elsewhere (plain data parallel under ZeRO-1's name) cannot know the warm state and fails."""
    hint = ("ZeRO-1 keeps a shard of the optimizer state on each rank. Which collective gives a rank the summed "
            "gradient of its own slice only, and which one brings the updated slices back to everyone? Mind the "
            "padding to a multiple of p.")
    for p in (2, 3):
        vals = launch_checked(exercise, _train_with_learner_step, p, args=(exercise, step_fn), hint=hint,
                              what=f"{p} ranks")
        ref, ref_m, ref_v = _single_adam_state(p, WARM + STEPS)
        for r, (params, calls, sizes, (m, v), (m0, v0)) in enumerate(vals):
            if sizes != (vals[0][2][0],) * 2 or sizes[0] != -(-ref.numel() // p):
                raise ExerciseFailed(with_hint(f"{exercise}: rank {r} of {p}: m and v must stay this rank's shards "
                                               f"of ceil(Ψ/p) = {-(-ref.numel() // p)} values, they have {sizes}.",
                                               hint))
            for step, made in enumerate(calls):
                if made != ["all_gather_single", "reduce_scatter_single"]:
                    raise ExerciseFailed(with_hint(f"{exercise}: rank {r} ran {made} in step {step + 1}; one flat "
                                                   "buffer means one reduce-scatter and one all-gather per step.",
                                                   hint))
            if torch.equal(m, m0) and torch.equal(v, v0):
                raise ExerciseFailed(with_hint(f"{exercise}: rank {r} of {p}: m and v are what they were before your "
                                               f"{STEPS} steps: the update did not use this rank's shard of Adam's "
                                               "state.", hint))
            if not torch.allclose(params, ref, atol=1e-5):
                bad = (params - ref).abs().max().item()
                raise ExerciseFailed(with_hint(f"{exercise}: with {p} ranks rank {r}'s weights differ from "
                                               f"single-process Adam by up to {bad:.3g} (the run started from "
                                               f"{WARM} steps of Adam: m and v arrive holding this rank's slice of "
                                               "its state).", hint))
            # m averages gradients of size ~1e-2, v their squares: float32 rounding is far below these tolerances
            if not (torch.allclose(m, _shard(ref_m, p, r), rtol=1e-3, atol=1e-7)
                    and torch.allclose(v, _shard(ref_v, p, r), rtol=1e-3, atol=1e-11)):
                raise ExerciseFailed(with_hint(f"{exercise}: rank {r} of {p}: the weights are right but m and v are "
                                               "not this rank's slice of Adam's state: was the update made with "
                                               "them?", hint))
    return passed(exercise, "weights equal single-process Adam on 2 and 3 ranks from a warm start, with one "
                            "reduce-scatter and one all-gather per step, and m, v each rank's slice of Adam's state")
