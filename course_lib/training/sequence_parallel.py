"""Sequence parallelism (序列并行) next to tensor parallelism: tokens split where the layer works token by token
(notebooks/13_tensor_parallel.ipynb, section 7).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198,
section 4.2.2) split the LayerNorm, dropout and residual regions of a transformer layer along the sequence and
join them to the tensor-parallel blocks with two conjugate operators: g, an all-gather of the tokens forward and a
reduce-scatter of their gradient backward; g-bar, a reduce-scatter of the row-parallel layer's partial sums forward
and an all-gather of the gradient backward. Tokens are the first dimension here, split evenly (the course's rule,
tensor_parallel.check_divisible). The notebook builds g and g-bar in cells; these are the library's copies, plus
the column-parallel Linear fused with g that keeps only this rank's tokens for backward, as Megatron-LM does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .tensor_parallel import check_divisible


def all_gather_tokens(x_mine: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's tokens (dimension 0), in rank order: one all-gather of p x this rank's bytes."""
    p = dist.get_world_size(group)
    out = x_mine.new_empty((p * x_mine.shape[0], *x_mine.shape[1:]))
    dist.all_gather_single(out, x_mine.contiguous(), group=group)
    return out


def reduce_scatter_tokens(x_all: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over ranks of x_all, keeping only this rank's tokens: one reduce-scatter."""
    p = dist.get_world_size(group)
    out = x_all.new_empty((check_divisible(x_all.shape[0], p, "number of tokens"), *x_all.shape[1:]))
    dist.reduce_scatter_single(out, x_all.contiguous(), group=group)
    return out


class GatherTokens(torch.autograd.Function):
    """Korthikanti's g: all-gather forward; backward, every rank holds a partial gradient of all tokens (its
    features only), so reduce-scatter: summed, and this rank's tokens kept (Korthikanti et al. 2022, 4.2.2)."""

    @staticmethod
    def forward(ctx, x_mine, group=None):
        ctx.group = group
        return all_gather_tokens(x_mine, group)

    @staticmethod
    def backward(ctx, grad_all):
        return reduce_scatter_tokens(grad_all, ctx.group), None


class ScatterTokens(torch.autograd.Function):
    """Korthikanti's g-bar: reduce-scatter of partial sums forward; backward, every rank's partial sums needed the
    gradient of every token, so all-gather it (Korthikanti et al. 2022, section 4.2.2)."""

    @staticmethod
    def forward(ctx, partial_all, group=None):
        ctx.group = group
        return reduce_scatter_tokens(partial_all, group)

    @staticmethod
    def backward(ctx, grad_mine):
        return all_gather_tokens(grad_mine, ctx.group), None


class _GatherLinear(torch.autograd.Function):
    """g fused with the column-parallel Linear after it: forward all-gathers the tokens and multiplies; backward
    keeps only this rank's tokens saved, all-gathers them again for the weight gradient and reduce-scatters the
    input gradient (Megatron-LM, megatron/core/tensor_parallel/layers.py,
    LinearWithGradAccumulationAndAsyncCommunication with sequence_parallel)."""

    @staticmethod
    def forward(ctx, x_mine, weight, bias, group):
        ctx.save_for_backward(x_mine, weight)       # 1/p of the tokens, not the gathered whole
        ctx.group, ctx.has_bias = group, bias is not None
        return nn.functional.linear(all_gather_tokens(x_mine, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_mine, weight = ctx.saved_tensors
        x_all = all_gather_tokens(x_mine, ctx.group)             # the price of keeping 1/p: one more all-gather
        grad_x = reduce_scatter_tokens(grad_out @ weight, ctx.group)
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = flat_grad.T @ x_all.reshape(-1, x_all.shape[-1])
        grad_b = flat_grad.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def gather_linear(x_mine, weight, bias=None, group=None):
    """linear(all-gathered tokens) with only x_mine kept for backward (see _GatherLinear)."""
    return _GatherLinear.apply(x_mine, weight, bias, group)


def gather_matmul(x_mine, A, group=None):
    """The same in Megatron's notation, Y = X A with A this rank's in x out/p columns and no bias: all-gathered
    tokens times A, only x_mine kept for backward (notebook 13, section 7)."""
    return _GatherLinear.apply(x_mine, A.T, None, group)


def gather_tokens(x_mine, group=None):
    """g: all-gather forward, reduce-scatter backward."""
    return GatherTokens.apply(x_mine, group)


def scatter_tokens(partial_all, group=None):
    """g-bar: reduce-scatter forward, all-gather backward."""
    return ScatterTokens.apply(partial_all, group)
