"""A small MLP for the digits, its parameters as one flat vector, and the single-process reference run (notebook 08).

The flat vector is what a parameter server stores and what a bucket all-reduces: one contiguous float32 tensor.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .data import combined_batch, load_digits


def make_mlp(hidden: int = 256, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """64 -> hidden -> hidden -> 10 with ReLU; the same seed gives the same initial weights on every rank (float64:
    the float32 weights, converted exactly)."""
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    return mlp.to(dtype)


def flat_params(model: nn.Module) -> torch.Tensor:
    """A detached copy of all parameters as one 1-D tensor (parameter order of model.parameters())."""
    return parameters_to_vector(model.parameters()).detach().clone()


def set_flat_params(model: nn.Module, flat: torch.Tensor) -> None:
    """Overwrite the model's parameters from one 1-D tensor (inverse of flat_params)."""
    with torch.no_grad():
        vector_to_parameters(flat, model.parameters())


def flat_grads(model: nn.Module) -> torch.Tensor:
    """All gradients as one 1-D tensor (a copy), zeros where a parameter has no gradient yet."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def train_single(n_workers: int, steps: int, batch_size: int, lr: float = 0.1, hidden: int = 256,
                 seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[float]]:
    """Plain SGD in one process on the combined batch of n workers per step: the weights every synchronous
    data-parallel run must end with (to tolerance.sgd_atol). Returns (final flat parameters, loss per step)."""
    x, y = load_digits()
    x = x.to(dtype)
    model = make_mlp(hidden, seed, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        xb, yb = combined_batch(x, y, n_workers, batch_size, step, seed)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return flat_params(model), losses
