"""Interleaved 1F1B on real ranks, and torch's plan for it replayed on an ideal clock (notebook 14, section 7).

Interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2): the model is cut into p*v stages and rank r holds stages
r, r + p, ..., so a micro-batch loops round the ranks v times. The notebook's cell builds each rank's
`PipelineStage`s and its `ScheduleInterleaved1F1B` (`build(parts, m)`); `train_interleaved` trains them with SGD as
notebook 14's other runs do, and returns the weights and torch's plan (`schedule.pipeline_order`). `replay` runs a
plan on the clock of course_lib.training.pipeline_schedules (forward 1, backward 2, messages free), each action
1/v as long, so its bubble and the activations a rank holds can be read off exactly.
"""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.distributed as dist

from ..runtime.devices import device
from .pipeline import make_deep_mlp, microbatches, stage_bounds


def torch_plan(schedule) -> dict[int, list[tuple[str, int, int]]]:
    """torch's plan for every rank, [(kind, stage, micro-batch)] with kind "FORWARD" or "FULL_BACKWARD" (the plan is
    made in the schedule's constructor, the same on every rank)."""
    return {r: [(a.computation_type.name, a.stage_index, a.microbatch_index) for a in acts if a is not None]
            for r, acts in schedule.pipeline_order.items()}


def train_interleaved(build, ms, v: int, data, steps: int = 3, batch: int = 32, lr: float = 0.1,
                      plans_for=range(1, 17)) -> dict:
    """On every rank: for each m in `ms`, the deep MLP cut into p*v stages, this rank's v of them handed to
    `build(parts, m)` ({stage index: layers} -> a schedule), `steps` steps of SGD. Returns {"params": {m: {stage:
    flat weights}}, "plans": {m: the m's plan}, and for every m in `plans_for` the plan or None where torch refuses
    that m ("plans_all"); those schedules are built, not run}."""
    rank, p = dist.get_rank(), dist.get_world_size()
    params, plans = {}, {}
    for m in ms:
        model = make_deep_mlp().to(device())
        cut = stage_bounds(model, p * v)
        parts = {s: model[slice(*cut[s])] for s in range(rank, p * v, p)}     # rank r: stages r, r + p, ...
        schedule = build(parts, m)
        for step in range(steps):
            xs, ys = microbatches(data, step, batch, m)
            model.zero_grad(set_to_none=True)
            if rank == 0:                                  # stage 0 is here: the whole batch goes in
                schedule.step(torch.cat(xs).to(device()))
            elif rank == p - 1:                            # the last stage is here: the targets
                schedule.step(target=torch.cat(ys).to(device()))
            else:
                schedule.step()
            with torch.no_grad():                          # plain SGD on the stages this rank holds
                for q in model.parameters():
                    if q.grad is not None:
                        q -= lr * q.grad
        params[m] = {s: torch.cat([q.detach().flatten() for q in layers.parameters()]).cpu()
                     for s, layers in parts.items()}
        plans[m] = torch_plan(schedule)
    plans_all = {}
    for m in plans_for:
        try:
            plans_all[m] = torch_plan(build(parts, m))
        except ValueError:                                 # torch: m must be a multiple of max(1, m // p)
            plans_all[m] = None
    return {"params": params, "plans": plans, "plans_all": plans_all}


def replay(order: dict, p: int, v: int, fwd=Fraction(1), bwd=Fraction(2)) -> list[list[tuple]]:
    """torch's plan (torch_plan's form) on an ideal clock: a stage's forward costs fwd/v, its backward bwd/v,
    messages are free. Returns each rank's [(kind, micro-batch, start, end)], kind "F" or "B", the micro-batch
    marked ' on the rank's later stages; raises on a deadlock."""
    acts, last = [order[r] for r in range(p)], p * v - 1
    done, free, nxt, out = {}, [Fraction(0)] * p, [0] * p, [[] for _ in range(p)]
    while any(nxt[r] < len(acts[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if nxt[r] == len(acts[r]):
                continue
            kind, s, i = acts[r][nxt[r]]
            if kind == "FORWARD":                          # needs the previous stage's forward of micro-batch i
                dep = ("FORWARD", s - 1, i) if s > 0 else None
            else:                                          # needs the next stage's backward (or its own forward)
                dep = ("FULL_BACKWARD", s + 1, i) if s < last else ("FORWARD", s, i)
            if dep is not None and dep not in done:
                continue                                   # rank r waits
            start = max(free[r], done[dep]) if dep else free[r]
            done[kind, s, i] = free[r] = start + (fwd if kind == "FORWARD" else bwd) / v
            out[r].append(("F" if kind == "FORWARD" else "B", f"{i}" + "'" * (s // p), start, free[r]))
            nxt[r] += 1
            moved = True
        if not moved:
            raise RuntimeError("every rank waits on another: the plan deadlocks")
    return out


def bubble(timeline, m: int, fwd=Fraction(1), bwd=Fraction(2)) -> Fraction:
    """Idle share of the replayed step: every rank computes m (fwd + bwd) in all, whatever v is."""
    return 1 - m * (fwd + bwd) / max(e for acts in timeline for *_, e in acts)


def warmup_forwards(acts) -> int:
    """Forwards a rank runs before its first backward."""
    return next(n for n, (k, *_) in enumerate(acts) if k == "B")


def peak_held(acts, v: int) -> Fraction:
    """Most forwards not yet backed at any point, in micro-batches of the rank's layers (each stage 1/v of them)."""
    live = [sum(1 if k == "F" else -1 for k, *_ in acts[:n]) for n in range(len(acts) + 1)]
    return Fraction(max(live), v)
