"""Activation recomputation measured on a stack of layers (notebook 14b, section 1): what a forward keeps for backward,
and the bytes alive op by op and the matrix FLOPs of a whole step, without recomputation ("none"), with full
recomputation ("full": torch.utils.checkpoint around each layer) or under a selective policy (a function for
torch.utils.checkpoint.create_selective_checkpoint_contexts). The checkpoint hides what it keeps from saved-tensor
hooks, so bytes are counted from the storages each op makes (KeptBytes, LiveBytes).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from ..training.threads import single_threaded
from .activations import KeptBytes, LiveBytes


def forward(layers: nn.ModuleList, how, x: torch.Tensor) -> torch.Tensor:
    """x through every layer: plainly ("none"), each layer checkpointed ("full"), or checkpointed under the policy
    `how`."""
    y = x
    for layer in layers:
        if how == "none":
            y = layer(y)
        elif how == "full":
            y = checkpoint(layer, y, use_reentrant=False)
        else:
            y = checkpoint(layer, y, use_reentrant=False,
                           context_fn=functools.partial(create_selective_checkpoint_contexts, how))
    return y


@single_threaded                  # layers this small only wait on a second intra-op thread
def kept_bytes(layers: nn.ModuleList, how, s: int, b: int = 1) -> int:
    """Bytes alive at the end of forward on an s x b x h input, made by the forward or being its input (the
    checkpoint keeps x, as ActivationMeter counts it); the output and the parameters are not counted."""
    x = torch.randn(s, b, layers[0].ln1.normalized_shape[0], requires_grad=True)
    with KeptBytes() as kept:
        y = forward(layers, how, x)
    return kept.bytes(exclude=[x, y, *layers.parameters()]) + x.untyped_storage().nbytes()


@single_threaded
def step_memory(layers: nn.ModuleList, how, s: int, b: int) -> tuple:
    """((bytes alive after each op of forward + backward, index where forward ends), (forward's matrix FLOPs, the
    whole step's)). The step makes its own gradients (zeroed to None first)."""
    layers.zero_grad(set_to_none=True)
    x = torch.randn(s, b, layers[0].ln1.normalized_shape[0], requires_grad=True)
    with LiveBytes() as live:
        y = forward(layers, how, x)
        end = live.mark()
        y.sum().backward()
    with FlopCounterMode(display=False) as flops:      # a second run: the counter would keep tensors alive
        y = forward(layers, how, x)
        fwd = flops.get_total_flops()
        y.sum().backward()
    return (live.timeline, end), (fwd, flops.get_total_flops())
