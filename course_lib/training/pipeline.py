"""Pipeline parallelism from send/recv: a deep MLP cut into stages, the GPipe and 1F1B schedules (notebook 14).

GPipe: Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism", NeurIPS 2019
(all forwards, then all backwards). 1F1B: PipeDream-Flush (Narayanan et al., "Memory-Efficient Pipeline-Parallel
DNN Training", ICML 2021), the schedule of Megatron-LM (Narayanan et al., SC'21, section 2.2.1): p - s - 1 warm-up
forwards on stage s, then one forward and one backward in turn, so at most p - s micro-batches are in flight. Both
give the gradient of the whole batch (gradient accumulation over micro-batches), so training ends with the weights
of single-process SGD. Compute can be emulated by fixed sleeps (Stage(fwd_s=...)) so that the bubble
(p - 1) / (m + p - 1) shows on a CPU shared by every rank; the real layers still run. The recorded order replayed on
an ideal clock gives the formula exactly; replayed with the run's measured action times and hand-off costs
(replayed_with_costs) it gives what the wall clock (measured_bubble) should show.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ..measure.activations import ActivationMeter
from ..measure.bubble import (  # noqa: F401  (measurements of a run's bubble; re-exported here)
    actions,
    hand_off_costs,
    measured_bubble,
    replayed_with_costs,
)
from ..measure.timeline import Timeline, region
from ..runtime.devices import device
from .data import combined_batch, load_digits
from .model import flat_params
from .pipeline_schedules import (  # noqa: F401  (the schedules live there; re-exported here)
    SCHEDULES,
    bubble_formula,
    gpipe_order,
    in_flight_formula,
    one_f_one_b_order,
    peak_in_flight,
    simulate,
    simulated_bubble,
)


# ---------------------------------------------------------------------------------------------- model and stages
def make_deep_mlp(layers: int = 8, hidden: int = 256, seed: int = 0) -> nn.Sequential:
    """The digits MLP made deeper: 64 -> hidden -> ... -> hidden -> 10, `layers` Linears with ReLU between them."""
    torch.manual_seed(seed)
    sizes = [64] + [hidden] * (layers - 1) + [10]
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def stage_bounds(model: nn.Sequential, p: int) -> list[tuple[int, int]]:
    """[start, end) of each stage's modules: the Linears split as evenly as possible, each ReLU with its Linear."""
    linears = [i for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    if not 1 <= p <= len(linears):
        raise ValueError(f"a model of {len(linears)} Linears can be cut into 1 to {len(linears)} stages, not {p}")
    cuts = [linears[len(linears) * s // p] for s in range(p)] + [len(model)]
    return [(cuts[s], cuts[s + 1]) for s in range(p)]


def _device_done(t: torch.Tensor) -> None:
    """Wait until the GPU has finished what was queued for `t` (NCCL's recv and kernels return before the data is
    there; the timeline must show a stage waiting for its input as idle, not as compute). Nothing on a CPU."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


class _BackwardStart(torch.autograd.Function):
    """Identity on a stage's output. Its backward runs first in the stage's backward: it opens the timeline's
    "compute B" region (closed by _BackwardEnd) and sleeps the emulated backward time."""

    @staticmethod
    def forward(ctx, out, stage):
        ctx.stage = stage
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        _device_done(grad)
        rf = region("compute", "B")
        rf.__enter__()
        ctx.stage._open_regions.append(rf)
        time.sleep(2 * ctx.stage.fwd_s)
        return grad, None


class _BackwardEnd(torch.autograd.Function):
    """Identity on a stage's input. Its backward runs last in the stage's backward (after every layer's): it closes
    the "compute B" region. `anchor` (a scalar that requires grad) keeps it in the graph on the first stage, whose
    input needs no gradient."""

    @staticmethod
    def forward(ctx, x, anchor, stage):
        ctx.stage, ctx.x_needs_grad = stage, x.requires_grad
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _device_done(grad)
        if ctx.stage._open_regions:
            ctx.stage._open_regions.pop().__exit__(None, None, None)
        return (grad if ctx.x_needs_grad else None), None, None


class Stage(nn.Module):
    """One stage's layers; `fwd_s` > 0 adds a fixed compute time (backward twice as long, as for a matrix multiply:
    two products per one of forward); `meter` counts the activations the layers keep for backward. The timeline's
    compute regions cover the stage's whole forward (its layers and the emulated time) and its whole backward, so
    what lies outside them is waiting, messages and the Python between actions."""

    def __init__(self, layers: nn.Sequential, fwd_s: float = 0.0, meter: ActivationMeter | None = None):
        super().__init__()
        self.layers, self.fwd_s, self.meter = layers, fwd_s, meter
        self._open_regions: list = []

    def forward(self, x):
        _device_done(x)
        anchor = None if x.requires_grad else torch.zeros((), device=x.device, requires_grad=True)
        x = _BackwardEnd.apply(x, anchor, self)
        with region("compute", "F"):
            if self.meter is not None:
                with self.meter:
                    out = self.layers(x)
            else:
                out = self.layers(x)
            time.sleep(self.fwd_s)
            _device_done(out)
        return _BackwardStart.apply(out, self)


def make_stage(p: int, rank: int, layers: int = 8, hidden: int = 256, fwd_s: float = 0.0, meter=None,
               groups=None) -> Stage:
    """Rank `rank`'s stage of make_deep_mlp cut into p: every rank builds the same model (same seed), keeps its part.
    `groups()` makes the stage's two process groups, (forward, backward); notebook 14 writes it in a cell."""
    model = make_deep_mlp(layers, hidden)
    start, end = stage_bounds(model, p)[rank]
    stage = Stage(nn.Sequential(*list(model)[start:end]), fwd_s, meter)
    # One process group per direction (every rank calls new_group, in the same order): NCCL runs a group's
    # sends and receives in issue order on its own stream, so activations going forward must not wait behind
    # gradients coming back, or two stages that send to each other wait for ever (notebook 04, section 6).
    stage.fwd, stage.bwd = groups() if groups is not None else (dist.new_group(), dist.new_group())
    return stage


# ---------------------------------------------------------------------------------------------- one step on ranks
def forward_one(stage: Stage, i: int, xs, ys, m: int, saved: dict, sends: list) -> float | None:
    """Micro-batch i's forward on this stage: receive its input from the previous stage (dist.recv), run the
    layers, send the output on (dist.isend: a stage never waits for its neighbour to take it), both on the
    stage's forward group. The last stage computes the loss / m instead (the mean over the whole batch)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        x = xs[i]
    else:
        x = torch.empty(len(xs[i]), stage_width(stage, "in"), device=device())
        dist.recv(x, src=rank - 1, group=stage.fwd)
        x.requires_grad_()
    out = stage(x)
    if rank == p - 1:
        out = nn.functional.cross_entropy(out, ys[i]) / m
    else:
        sends.append(dist.isend(out.detach(), dst=rank + 1, group=stage.fwd))
    saved[i] = (x, out)
    return out.item() if rank == p - 1 else None


def backward_one(stage: Stage, i: int, saved: dict, sends: list) -> None:
    """Micro-batch i's backward: the gradient of the output from the next stage (the loss itself on the last),
    backward through the layers (gradients accumulate), the input's gradient sent to the previous stage, both on
    the stage's backward group."""
    rank, p = dist.get_rank(), dist.get_world_size()
    x, out = saved.pop(i)
    if rank == p - 1:
        out.backward()
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank + 1, group=stage.bwd)
        out.backward(grad)
    if rank > 0:
        sends.append(dist.isend(x.grad, dst=rank - 1, group=stage.bwd))


def run_order(stage: Stage, order, xs, ys, m: int) -> list[float]:
    """One step of any schedule given as this stage's order of ("F", i) / ("B", i): the library's executor."""
    saved, sends, losses = {}, [], []
    for kind, i in order:
        if kind == "F":
            loss = forward_one(stage, i, xs, ys, m, saved, sends)
            if loss is not None:
                losses.append(loss)
        else:
            backward_one(stage, i, saved, sends)
    for w in sends:
        w.wait()
    return losses


def stage_width(stage: Stage, side: str) -> int:
    """Features entering (side="in") or leaving ("out") the stage."""
    linears = [mod for mod in stage.layers if isinstance(mod, nn.Linear)]
    return linears[0].in_features if side == "in" else linears[-1].out_features


def microbatches(data, step: int, batch: int, m: int) -> tuple[list, list]:
    """The step's batch of the digits (as single-process training sees it) cut into m equal micro-batches."""
    if batch % m:
        raise ValueError(f"the batch of {batch} does not split into {m} equal micro-batches; pick m dividing {batch}")
    x, y = combined_batch(*data, 1, batch, step)
    return [c.clone() for c in x.chunk(m)], [c.clone() for c in y.chunk(m)]   # each its own tensor, as a loader gives


def train_stage(step_fn, steps: int = 3, m: int = 4, batch: int = 32, lr: float = 0.1, layers: int = 8,
                hidden: int = 256, fwd_s: float = 0.0, record: bool = False, data=None, groups=None) -> dict:
    """On every rank: its stage trained with SGD, each step's gradients from `step_fn(stage, xs, ys, m)` (one
    pipeline step with send/recv; returns the last stage's micro-batch losses). With `record`, the last step runs
    under a Timeline (its compute regions only, see Stage) and only that step has the emulated compute `fwd_s`: the
    steps before it bring the weights there, and their sleeps would show nowhere. Every step runs under an
    ActivationMeter: the peak bytes kept for backward, one micro-batch's.
    `data`: the digits (x, y) if the caller has them already (parsing them costs every rank a moment); `groups`:
    make_stage's maker of the (forward, backward) process groups."""
    rank, p = dist.get_rank(), dist.get_world_size()
    meter = ActivationMeter()
    stage = make_stage(p, rank, layers, hidden, fwd_s, meter, groups).to(device())
    data, losses, events = data or load_digits(), [], []
    for step in range(steps):
        recorded = record and step == steps - 1
        stage.fwd_s = fwd_s if recorded or not record else 0.0
        xs, ys = microbatches(data, step, batch, m)
        xs, ys = [x.to(device()) for x in xs], [y.to(device()) for y in ys]
        stage.zero_grad()
        meter.peak, meter.records = meter.live, []
        with Timeline(recorded, torch_ops=False) as tl:
            losses.append(sum(step_fn(stage, xs, ys, m) or []))
        events = tl.events or events
        with torch.no_grad():
            for q in stage.parameters():
                q -= lr * q.grad
    per_mb = sum(b for _, _, b in meter.records) // m
    return {"params": flat_params(stage).cpu(), "losses": losses if rank == p - 1 else [], "events": events,
            "peak_bytes": meter.peak, "microbatch_bytes": per_mb}


def pipeline_train(schedule: str = "1f1b", **kwargs) -> dict:
    """train_stage with the library's schedule `schedule` ("gpipe" or "1f1b") run by run_order."""
    order_fn = SCHEDULES[schedule]
    return train_stage(lambda st, xs, ys, m: run_order(st, order_fn(dist.get_rank(), dist.get_world_size(), m),
                                                       xs, ys, m), **kwargs)


def train_reference(steps: int = 3, batch: int = 32, lr: float = 0.1, layers: int = 8, hidden: int = 256):
    """Single-process SGD on the whole batch of each step: the weights every pipeline run must end with."""
    model, data = make_deep_mlp(layers, hidden), load_digits()
    losses = []
    for step in range(steps):
        x, y = combined_batch(*data, 1, batch, step)
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for q in model.parameters():
                q -= lr * q.grad
    return model, losses


def stage_params(model: nn.Sequential, p: int) -> list[torch.Tensor]:
    """The single-process model's parameters cut as the p stages hold them (flat, one tensor per stage)."""
    return [flat_params(nn.Sequential(*list(model)[a:b])) for a, b in stage_bounds(model, p)]
