"""Checker for notebook 14b's exercise 14b.2: a selective-recomputation policy that keeps no tensor growing with s².

The learner's policy (a function `policy(ctx, op, *args, **kwargs)` returning a CheckpointPolicy, or a list of ops
to keep, both of which torch.utils.checkpoint.create_selective_checkpoint_contexts takes) runs around two of the
course's TransformerLayers, in this process: activation memory is a question of one GPU, so no ranks are needed.

- Bytes: what the checkpointed layers keep for backward is measured with KeptBytes at sequence lengths s and 2s. Every
  tensor of s·b·h or s·b values doubles with s, an a·s²·b one quadruples: the bytes must double exactly.
- FLOPs: FlopCounterMode counts the matrix FLOPs of forward + backward by op. The Linear layers' products (aten.mm,
  aten.addmm) must run exactly as often as without checkpointing: none of them recomputed.
- Gradients: equal to the same layers run without checkpointing.

Two layer shapes, one with dropout and one without (their op sequences differ), each at two lengths, so that a policy
tuned to one op sequence or one tensor size fails. Nothing is switched off: torch ships no policy that answers this,
and full recomputation, the shortcut that also removes the s² term, fails the FLOP test.
"""

from __future__ import annotations

import torch
from torch import nn

from ..measure.activations import KeptBytes, TransformerLayer
from ..measure.recompute import forward
from ..training.threads import single_threaded
from .core import ExerciseFailed, not_attempted, passed, with_hint

LAYERS = 2
CASES = ((64, 4, 128, 4, 0.1), (16, 2, 32, 4, 0.0))    # s, b, h, a, dropout; each also run at 2s
LINEAR_OPS = ("aten.mm", "aten.addmm")                 # a Linear's forward (addmm) and its two backward products (mm)
HINT = ("Which tensors in a layer have s x s entries per head, which ops make them, and what does each of those ops' "
        "backward need? The expensive products are the ones worth keeping.")


@single_threaded          # layers this small only wait on a second intra-op thread
def _run(how, s, b, h, a, dropout):
    """(bytes kept for backward, matrix FLOPs by op, gradients) for two layers run without checkpointing ("none"),
    with full recomputation ("full"), or under the selective policy `how`."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    layers = nn.ModuleList(TransformerLayer(h, a, dropout) for _ in range(LAYERS))
    x = torch.randn(s, b, h, requires_grad=True)
    with FlopCounterMode(display=False) as flops:
        with KeptBytes() as kept:
            y = forward(layers, how, x)
        # x and y are the caller's; x counts, as the checkpoint keeps it (the notebook's cell counts it the same way)
        held = kept.bytes(exclude=[x, y, *layers.parameters()]) + x.untyped_storage().nbytes()
        y.sum().backward()
    by_op = {str(op): n for op, n in flops.get_flop_counts()["Global"].items()}
    return held, by_op, [x.grad, *(q.grad for q in layers.parameters())]


def _learner_run(exercise, policy, case):
    try:
        return _run(policy, *case)
    except NotImplementedError as e:
        raise not_attempted(exercise, str(e)) from None
    except Exception as e:
        why = ""
        if "has been mutated" in str(e):       # torch refuses to save an output that a later op writes in place
            why = (" An op whose output a later op overwrites in place cannot be kept: on a CPU, dropout makes its "
                   "noise with empty_like and fills it in place (bernoulli_, div_). Recompute those ops, or keep "
                   "only what you name and recompute the rest.")
        raise ExerciseFailed(with_hint(f"{exercise}: two layers at s = {case[0]} under your policy raised "
                                       f"{type(e).__name__}: {e}.{why}", HINT)) from None


def check_selective_policy(policy, exercise: str = "Exercise 14b.2 (selective recomputation)") -> None:
    """`policy` for create_selective_checkpoint_contexts: keeps no a·s²·b tensor and recomputes no Linear product."""
    shown = None
    for s, b, h, a, dropout in CASES:
        where = f"s = {s}, b = {b}, h = {h}, a = {a}, {'with' if dropout else 'without'} dropout"
        kept, flops, grads = _learner_run(exercise, policy, (s, b, h, a, dropout))
        kept2, _, _ = _learner_run(exercise, policy, (2 * s, b, h, a, dropout))
        plain, plain_flops, plain_grads = _run("none", s, b, h, a, dropout)
        if kept2 != 2 * kept:
            raise ExerciseFailed(with_hint(
                f"{exercise}: {where}: your policy keeps {kept:,} B for backward, and {kept2:,} B at s = {2 * s}: "
                f"{kept2 / kept:.2f} times as much, not 2. Something it keeps grows with s² (no recomputation keeps "
                f"{plain:,} B here).", HINT))
        linear, plain_linear = (sum(f.get(op, 0) for op in LINEAR_OPS) for f in (flops, plain_flops))
        if linear != plain_linear:
            raise ExerciseFailed(with_hint(
                f"{exercise}: {where}: the Linear layers' products (aten.mm, aten.addmm) ran {linear:,} FLOPs in "
                f"forward + backward, {plain_linear:,} without checkpointing: your policy recomputes some of them, "
                f"the price of full recomputation.", HINT))
        # the recomputed ops are the same kernels on the same inputs, with the random state restored for dropout:
        # the gradients agree to float32 rounding (u = 6e-8 relative) over a few dozen operations, well under 1e-5
        diff = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for g, r in zip(grads, plain_grads))
        if not diff <= 1e-5:
            raise ExerciseFailed(with_hint(
                f"{exercise}: {where}: the gradients differ from the layers' without checkpointing by {diff:.2g} "
                f"(relative): a recomputed op must give what the forward gave.", HINT))
        if shown is None:
            full, full_flops, _ = _run("full", s, b, h, a, dropout)
            total, plain_total, full_total = (sum(f.values()) for f in (flops, plain_flops, full_flops))
            shown = (f"{LAYERS} layers at s = {s}, b = {b}, h = {h}, a = {a}: keeps {kept:,} B (no recomputation "
                     f"{plain:,} B, full {full:,} B), exactly twice as much at s = {2 * s}; matrix FLOPs of forward + "
                     f"backward {total / plain_total - 1:+.1%} at s/h = {s}/{h} (full recomputation "
                     f"{full_total / plain_total - 1:+.1%}), "
                     f"no Linear recomputed; the same without dropout; gradients equal the plain run's")
    passed(exercise, shown)
