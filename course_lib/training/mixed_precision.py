"""Mixed precision: 16-bit compute, fp32 master weights, loss scaling, and the bytes each keeps (notebook 14b).

Micikevicius et al., "Mixed Precision Training", ICLR 2018: compute in fp16, keep an fp32 master copy of the weights
for the update (section 3.1), and scale the loss so that small gradients do not flush to zero in fp16 (section 3.2).
ZeRO (Rajbhandari et al., SC'20, section 3.1) counts the state with Adam: 2 (fp16 weights) + 2 (fp16 gradients) + 12
(fp32 master weights, momentum, variance) = 16 bytes per parameter. Dynamic loss scaling follows the rules of
torch.amp.GradScaler: an inf or NaN gradient skips the step and multiplies the scale by 0.5; after
`growth_interval` finite steps in a row the scale doubles.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..measure.memory import held_bytes
from .adam import adam_step


def number_format(dtype: torch.dtype) -> dict:
    """Largest value, smallest normal and smallest subnormal of a float format, and its unit roundoff."""
    fi = torch.finfo(dtype)
    # the smallest subnormal is the smallest normal times the spacing of the mantissa (fp16: 2^-14 x 2^-10 = 2^-24)
    return {"max": fi.max, "min_normal": fi.tiny, "min_subnormal": fi.tiny * fi.eps, "unit_roundoff": fi.eps / 2}


def gradients(model: nn.Module, x, y, dtype: torch.dtype | None = None, scale: float = 1.0) -> list[torch.Tensor]:
    """The parameter gradients of the mean cross-entropy, computed under autocast(dtype) (None: plain fp32) with
    the loss multiplied by `scale` before backward and the gradients divided by it after (fp32 weights)."""
    model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = nn.functional.cross_entropy(model(x), y)
    (loss * scale).backward()
    return [q.grad / scale for q in model.parameters()]


def lost_entries(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> tuple[int, int]:
    """(gradient entries that are zero here but not in the fp32 reference, entries non-zero in the reference)."""
    lost = sum(int(((g == 0) & (r != 0)).sum()) for g, r in zip(grads, reference))
    return lost, sum(int((r != 0).sum()) for r in reference)


def activation_gradients(model: nn.Sequential, x, y) -> torch.Tensor:
    """Every entry of dLoss/d(activation) after each layer, fp32, one flat tensor (for a histogram of magnitudes)."""
    outs = []
    h = x
    for layer in model:
        h = layer(h)
        h.retain_grad()
        outs.append(h)
    nn.functional.cross_entropy(h, y).backward()
    return torch.cat([o.grad.reshape(-1) for o in outs])


class LossScaler:
    """Dynamic loss scaling with GradScaler's rules, on plain numbers: update(found_inf) -> did the step happen."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, backoff_factor
        self.growth_interval, self.good_steps = growth_interval, 0

    def update(self, found_inf: bool) -> bool:
        if found_inf:
            self.scale *= self.backoff_factor         # too large: something overflowed; skip and back off
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:   # a long run without overflow: try a larger scale
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True


class MasterWeights:
    """Mixed precision by hand (Micikevicius et al. 2018, figure 1): a 16-bit copy of the model does forward and
    backward; the fp32 master weights and Adam's fp32 moments take the update, then refresh the 16-bit copy."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float16, lr: float = 1e-3):
        self.model = copy.deepcopy(model).to(dtype)                       # 2 bytes per parameter
        self.master = [q.detach().clone().float() for q in model.parameters()]   # 4
        self.m = [torch.zeros_like(w) for w in self.master]              # 4
        self.v = [torch.zeros_like(w) for w in self.master]              # 4
        self.lr, self.t = lr, 0

    def backward(self, x, y, scale: float) -> float:
        """Forward and backward in 16 bits on the loss times `scale`; the 16-bit gradients stay in .grad (2 bytes)."""
        for q in self.model.parameters():
            q.grad = None
        loss = nn.functional.cross_entropy(self.model(x.to(self.dtype)), y)
        (loss * scale).backward()
        return loss.item()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def found_inf(self) -> bool:
        return any(not torch.isfinite(q.grad).all() for q in self.model.parameters())

    def step(self, scale: float) -> None:
        """Unscale each gradient into fp32 (one tensor at a time), Adam on the master weights, copy back to 16 bits."""
        self.t += 1
        for q, w, m, v in zip(self.model.parameters(), self.master, self.m, self.v):
            adam_step(w, q.grad.float() / scale, m, v, self.t, self.lr)
            with torch.no_grad():
                q.copy_(w)                                               # rounds to the 16-bit format

    def held(self) -> dict:
        """Bytes held per category, measured from the tensors (measure.memory.held_bytes)."""
        params = list(self.model.parameters())
        out = {"weights": held_bytes(params), "grads": held_bytes(q.grad for q in params),
               "optimizer": held_bytes(self.master + self.m + self.v)}
        out["total"] = sum(out.values())
        return out
