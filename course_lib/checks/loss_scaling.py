"""Checker for notebook 14b's exercise 14b.1: dynamic loss scaling across pipeline stages.

The learner's loss-scaled step runs on real ranks, one stage each, with an inf or a NaN injected on one stage, on two
stages and on every stage at once (in a real pipeline an inf in a late stage's backward flows into every earlier
stage's gradients, so a count of flags must not be read as "exactly one"), against GradScaler's rules
(training.mixed_precision.LossScaler), counting the collectives with CommLog. Each stage has its own shape
(nn.Linear(4, 4 + rank)), as a real pipeline's stages do, so a collective over the gradients themselves fails as it
would there. While it runs, the course's LossScaler, torch's GradScaler, FSDP's ShardedGradScaler (a pure-Python copy
of the same rules on CPU) and GradScaler's two kernels (torch._amp_foreach_non_finite_check_and_unscale_,
torch._amp_update_scale_) are switched off (switch_off.py). Allowed: any one collective on a flag (or flags) made on
the stage's device, any way of testing the gradients for inf and NaN.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.launch import run
from ..runtime.results import RankFailed
from ..training.mixed_precision import LossScaler
from .core import ExerciseFailed, not_attempted, passed
from .pipeline import _switched_off
from .switch_off import SwitchedOff

# ---------------------------------------------------------------------------------------------- 14b.1
STEPS = 12
INF, NAN = float("inf"), float("nan")
# step -> [(stage, its bad value, the parameter it is in)]: a bias too, so a check of the weight alone fails; stage -1
# stands for every stage. Steps 8 and 10 overflow on several stages at once, as an inf from a late stage's backward does
OVERFLOW = {2: [(1, INF, "weight")], 3: [(0, NAN, "bias")], 5: [(1, NAN, "weight")], 6: [(0, INF, "bias")],
            8: [(0, INF, "weight"), (1, NAN, "bias")], 10: [(-1, INF, "weight")]}
GRAD_SCALER = "torch.amp.grad_scaler.GradScaler"
GRAD_SCALER_METHODS = ("unscale_", "step", "update")
AMP_KERNELS = ("_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_")   # GradScaler's own, as torch ops
SHARDED = "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler"
SHARDED_METHODS = ("unscale_", "_unscale_grads_", "_amp_update_scale_cpu_", "update")


@contextmanager
def _no_amp_kernels(exercise: str):
    """GradScaler's two kernels refused however they are reached (torch._amp_update_scale_, torch.ops.aten....):
    a dispatch mode sees the aten operator that every road ends in."""
    from . import switch_off

    class NoAmp(switch_off._dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if func.namespace == "aten" and name in AMP_KERNELS:
                message = switch_off._say(exercise, "loss scaling by hand", f"GradScaler's kernel torch.{name}")
                switch_off._attempts.append(message)
                raise SwitchedOff(message)
            return func(*args, **(kwargs or {}))

    with NoAmp():
        yield


def _bad_here(step: int, rank: int) -> list:
    return [(bad, where) for r, bad, where in OVERFLOW.get(step, []) if r in (rank, -1)]


def _said(step: int) -> str:
    """The overflow of a step in words: "a bias gradient on stage 0 is nan", "... and ...", "on every stage"."""
    return " and ".join(f"a {where} gradient on {'every stage' if r == -1 else f'stage {r}'} is {bad}"
                        for r, bad, where in OVERFLOW[step])


@contextmanager
def _scalers_off(exercise: str):
    """The course's LossScaler, torch's GradScaler (named as torch's, not the course's), its kernels and FSDP's
    ShardedGradScaler off while the learner's step runs."""
    from . import switch_off

    why = "loss scaling by hand"
    with _switched_off(exercise, why, library=[*(f"{GRAD_SCALER}.{m}" for m in GRAD_SCALER_METHODS),
                                               "course_lib.training.mixed_precision.LossScaler.update"]):
        for m in GRAD_SCALER_METHODS:
            switch_off._refusals[f"{exercise}:{GRAD_SCALER}.{m}"] = switch_off._say(exercise, why,
                                                                                  f"torch's GradScaler.{m}")
        with _no_amp_kernels(exercise), _no_sharded_scaler(exercise):
            yield


@contextmanager
def _no_sharded_scaler(exercise: str):
    """FSDP's ShardedGradScaler off: its unscale_ all-reduces the overflow flag and its CPU update is GradScaler's rule
    in plain Python, so no aten kernel of GradScaler's would see it."""
    from . import switch_off

    why = "loss scaling by hand"
    stubs = switch_off.library_stubs([f"{SHARDED}.{m}" for m in SHARDED_METHODS], exercise, why)
    for m in SHARDED_METHODS:     # named as the learner would call it, not as a dist.* collective
        switch_off._refusals[f"{exercise}:{SHARDED}.{m}"] = switch_off._say(exercise, why,
                                                                            f"torch's ShardedGradScaler.{m}")
    for fn, _, stub in stubs:
        fn.__code__ = stub
    try:
        yield
    finally:
        for fn, code, _ in stubs:
            fn.__code__ = code


def _loss_scaling_case(learner, growth_interval, lr):
    from ..measure.comm_log import CommLog
    from ..runtime.devices import device
    rank = dist.get_rank()
    torch.manual_seed(rank)
    stage = nn.Linear(4, 4 + rank).to(device())      # stages differ in shape, as a pipeline's do
    scaler = {"scale": 2.0 ** 10, "good_steps": 0, "growth_interval": growth_interval}
    history = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        for q in stage.parameters():
            q.grad = (torch.randn(q.shape, generator=g) * scaler["scale"]).to(q.device)   # of loss x scale
        for bad, where in _bad_here(step, rank):
            getattr(stage, where).grad.view(-1)[0] = bad
        with CommLog() as log:
            with _scalers_off("Exercise 14b.1"):
                stepped = learner(stage, lr, scaler)
        history.append((bool(stepped), scaler["scale"], scaler["good_steps"], [c.op for c in log.calls],
                        [q.detach().cpu().clone() for q in stage.parameters()]))
    return history


def _reference_history(rank, growth_interval, lr):
    torch.manual_seed(rank)
    stage = nn.Linear(4, 4 + rank)
    sc = LossScaler(2.0 ** 10, growth_interval=growth_interval)
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        grads = [torch.randn(q.shape, generator=g) * sc.scale for q in stage.parameters()]
        found = step in OVERFLOW                        # on one stage or more, so on every stage
        scale = sc.scale
        if sc.update(found):
            with torch.no_grad():
                for q, gr in zip(stage.parameters(), grads):
                    q -= lr * gr / scale
        out.append((not found, sc.scale, sc.good_steps, [q.detach().clone() for q in stage.parameters()]))
    return out


def check_loss_scaling(scaled_sgd_step, exercise: str = "Exercise 14b.1 (loss scaling across stages)") -> None:
    """`scaled_sgd_step(stage, lr, scaler)` on every pipeline stage: the stage's .grad hold gradients of
    loss x scaler["scale"]; unscale, skip the step on every stage if any stage's gradients hold inf/NaN (one
    collective), update scaler["scale"] and scaler["good_steps"] by GradScaler's rules; return whether it stepped."""
    hint = ("What must every stage know before any of them touches its weights, and which values count as an "
            "overflow? Reread the statement's rules for the scale, step by step, against the numbers above.")
    lr, growth = 0.1, 2
    for world in (2, 3):
        try:
            vals = run(_loss_scaling_case, world_size=world, args=(scaled_sgd_step, growth, lr), output="none",
                       timeout=60, nccl_rules=True).values
        except RankFailed as e:
            if e.failure.etype == "NotImplementedError":
                raise not_attempted(exercise, e.failure.message) from None
            if e.failure.etype == "SwitchedOff":
                raise ExerciseFailed(f"{e.failure.message}\nHint: {hint}") from None
            raise ExerciseFailed(f"{exercise}: rank {e.rank} failed with {world} stages (each stage's weight has its "
                                 f"own shape, 4 + rank rows):\n{e}\nHint: {hint}") from None
        refs = [_reference_history(rank, growth, lr) for rank in range(world)]
        for step in range(STEPS):
            per_rank = [h[step] for h in vals]
            stepped = [h[0] for h in per_rank]
            if len(set(stepped)) > 1:
                who = ", ".join(f"stage {r} {'stepped' if s else 'skipped'}" for r, s in enumerate(stepped))
                raise ExerciseFailed(
                    f"{exercise}: {world} stages, step {step}: {who}. The overflow: {_said(step)}; a pipeline "
                    f"step is one step of the whole model, so every stage must skip it together.\nHint: {hint}")
            for rank, got in enumerate(per_rank):
                want = refs[rank][step]
                if got[0] != want[0]:
                    bad = "run" if want[0] else f"be skipped ({_said(step)})"
                    raise ExerciseFailed(f"{exercise}: {world} stages, step {step}: your step "
                                         f"{'ran' if got[0] else 'was skipped'}; it should {bad}.\nHint: {hint}")
                if (got[1], got[2]) != (want[1], want[2]):
                    raise ExerciseFailed(
                        f"{exercise}: {world} stages, step {step}, stage {rank}: after the step scale = {got[1]:g}, "
                        f"good_steps = {got[2]}; expected scale = {want[1]:g}, good_steps = {want[2]} (growth_interval "
                        f"{growth}).\nHint: {hint}")
                diff = max((a - b).abs().max().item() for a, b in zip(got[4], want[3]))
                # 1e-6: updates of about lr x 1 = 0.1 on weights below 1, in float32 (u = 6e-8): lr, grad and 1/scale
                # multiplied in another order differ by a few roundings, ~1e-8; a wrong scale or a missed skip, >= 1e-2
                if not diff <= 1e-6:                  # also a NaN that reached the weights
                    raise ExerciseFailed(
                        f"{exercise}: {world} stages, step {step}, stage {rank}: weights differ from the reference by "
                        f"{diff:.3g}. Each stage updates its own weights with its own gradients, which hold loss x "
                        f"the scale they were made with: is that the scale you divide by?\nHint: {hint}")
                if len(got[3]) != 1:  # any one collective that tells every stage: an all_reduce, an all_gather, ...
                    raise ExerciseFailed(
                        f"{exercise}: {world} stages, step {step}, stage {rank}: your step ran {got[3] or 'no '} "
                        f"collectives; how many does it take for every stage to agree on one bit?\nHint: {hint}")
    passed(exercise, f"2 and 3 stages, {STEPS} steps with an inf or a NaN on one stage, on two and on every stage at "
                     f"once: every stage skips together, scale and weights follow GradScaler's rules, one collective "
                     f"per step")
