"""Adam written out on plain tensors, and the single-process Adam run every sharded scheme must reproduce (notebook 12).

Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization", Algorithm 1. Written by hand, not torch.optim.Adam,
for two reasons: torch.optim's first step costs seconds in every fresh rank process on a small CPU (see
allreduce.py), and the state it keeps (momentum m and variance v, 8 bytes per fp32 parameter) is exactly what ZeRO
shards. Adam is elementwise, so updating a slice of the parameters with the same slice of m, v and the gradient gives
the same numbers as updating everything and then slicing: the fact that makes ZeRO exact.
"""

from __future__ import annotations

import torch
from torch import nn

from .data import combined_batch, load_digits
from .model import flat_params, make_mlp

BETAS = (0.9, 0.999)
EPS = 1e-8


@torch.no_grad()
def adam_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, lr: float,
              betas: tuple[float, float] = BETAS, eps: float = EPS) -> None:
    """One Adam update of `param` in place, m and v updated in place; t counts steps from 1 (Kingma & Ba, Alg. 1)."""
    b1, b2 = betas
    m.mul_(b1).add_(grad, alpha=1 - b1)                    # m_t = b1 m + (1 - b1) g
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)          # v_t = b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1 ** t)                              # bias corrections: m and v start at zero
    v_hat = v / (1 - b2 ** t)
    param.addcdiv_(m_hat, v_hat.sqrt_().add_(eps), value=-lr)


def train_single_adam(n_workers: int, steps: int, batch_size: int, lr: float = 1e-3, hidden: int = 256,
                      seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[float]]:
    """Adam in one process on the combined batch of n workers per step: the weights every synchronous data-parallel
    or ZeRO/FSDP run with Adam must end with (in float64, to tolerance.adam_atol). Returns (final flat parameters,
    loss per step)."""
    x, y = load_digits()
    x = x.to(dtype)
    model = make_mlp(hidden, seed, dtype)
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    losses = []
    for step in range(steps):
        xb, yb = combined_batch(x, y, n_workers, batch_size, step, seed)
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        for p, mp, vp in zip(params, m, v):
            adam_step(p, p.grad, mp, vp, step + 1, lr)
        losses.append(loss.item())
    return flat_params(model), losses
