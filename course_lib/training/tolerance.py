"""How close a parallel run must end to its single-process reference: what float rounding allows (notebooks 08-17).

Both runs do the same arithmetic in another order: a gradient summed per rank and then across ranks (all-reduce,
reduce-scatter, a server's average, tensor parallelism's partial sums) instead of over the combined batch at once;
another CPU's kernels, another BLAS or a GPU block the same sums differently again. A sum of n terms, in any order,
is within (n - 1)·u·Σ|terms| of the exact sum (u: the unit roundoff, 2^-24 ≈ 6e-8 in float32, 2^-53 ≈ 1.1e-16 in
float64; Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed. 2002, section 4.2), so two orders differ
by at most 2n·u·Σ|terms|. The bounds below carry that through the optimizer's steps to first order (a weight that
differs changes the next gradient only by a second-order amount over the few steps the lessons run). They assume
what the course models satisfy: per-sample gradient entries below GRAD and weights below WEIGHT in size
(tests/test_portability.py checks both, and that every bound is far above the spread of reordered runs and far
below what a wrong algorithm changes). They assume full float32 matrix products: torch's default, not TF32.
"""

from __future__ import annotations

import math

import torch

from .adam import BETAS, EPS

GRAD = 2.0     # |one sample's gradient entry|: at most 1.3 for the digits MLP in its first 30 steps (SGD or Adam)
WEIGHT = 1.0   # |a weight|: below 0.2 for the digits MLP


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u: the largest relative error of one rounding (half the distance from 1.0 to the next number)."""
    return torch.finfo(dtype).eps / 2


def sum_atol(terms: int, total: float, dtype: torch.dtype = torch.float32) -> float:
    """Two float sums of the same `terms` numbers in different orders, their sizes adding up to `total`, differ by at
    most 2·terms·u·total (Higham 2002, eq. 4.4, once per order)."""
    return 2 * terms * unit_roundoff(dtype) * total


def grad_atol(batch: int, width: int, dtype: torch.dtype = torch.float32, grad: float = GRAD) -> float:
    """One gradient entry of a mean loss over `batch` samples, back-propagated through layers at most `width` wide:
    its batch sum (Σ|terms| ≤ grad, the mean of per-sample entries) and the width sums that feed it, each reordered."""
    return sum_atol(batch + width, grad, dtype)


def sgd_atol(steps: int, lr: float, batch: int, width: int, dtype: torch.dtype = torch.float32,
             momentum: float = 0.0, grad: float = GRAD, weight: float = WEIGHT) -> float:
    """Weights after `steps` SGD steps: each step adds lr·(gradient difference), times 1/(1 - momentum) at most once
    momentum has summed it into the velocity, plus the rounding of w - lr·g itself (2u·|w|)."""
    per_step = lr / (1 - momentum) * grad_atol(batch, width, dtype, grad) + 2 * unit_roundoff(dtype) * weight
    return steps * per_step


def adam_ratio_bound(t: int, betas: tuple[float, float] = BETAS) -> float:
    """The largest |m̂|/√v̂ after t steps, whatever the gradients: √(Σ a_i²/c_i) for Adam's bias-corrected averaging
    weights a (momentum) and c (variance), by Cauchy-Schwarz; 1 at t = 1, 1.01 at t = 5 (Kingma & Ba 2015, 2.1)."""
    b1, b2 = betas
    a = [(1 - b1) * b1 ** (t - i) / (1 - b1 ** t) for i in range(1, t + 1)]
    c = [(1 - b2) * b2 ** (t - i) / (1 - b2 ** t) for i in range(1, t + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, c)))


def adam_atol(steps: int, lr: float, batch: int, width: int, dtype: torch.dtype = torch.float64,
              eps: float = EPS, betas: tuple[float, float] = BETAS, grad: float = GRAD,
              weight: float = WEIGHT) -> float:
    """Weights after `steps` Adam steps. A gradient difference δ moves m̂ (a weighted mean) and √v̂ (a weighted RMS)
    by at most δ each, so the step lr·m̂/(√v̂ + ε) moves by at most lr·(1 + B)·δ/ε, B = adam_ratio_bound; and by
    no more than 2·lr·B, both steps being at most lr·B. Dividing by ε = 1e-8 is why float32 tells nothing here
    (the bound is Adam's whole step) and float64 checks the algorithm to about 1e-7."""
    delta = grad_atol(batch, width, dtype, grad)
    total = 0.0
    for t in range(1, steps + 1):
        b = adam_ratio_bound(t, betas)
        total += lr * min((1 + b) * delta / eps, 2 * b) + 2 * unit_roundoff(dtype) * weight
    return total


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over every element, as a Python float (compared in float64 so the check adds no rounding)."""
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()
