"""Bytes a rank holds for parameters, gradients and optimizer state: measured from its tensors, and the formulas.

Taught in notebooks/12_sharded_data_parallel.ipynb. The formulas are the ZeRO paper's (Rajbhandari et al., SC'20,
figure 1 and section 5): with Ψ parameters, p ranks and K bytes of optimizer state per parameter, plain data
parallel holds (w + g + K)Ψ per rank; ZeRO-1 (optimizer states sharded) wΨ + gΨ + KΨ/p; ZeRO-2 (+ gradients)
wΨ + (g + K)Ψ/p; ZeRO-3 (+ parameters) (w + g + K)Ψ/p. fp32 Adam: w = g = 4, K = 8 (momentum, variance);
mixed precision: w = g = 2, K = 12 (fp32 master weights, momentum, variance); 16 bytes per parameter either way
(hardware.STATE_BYTES_PER_PARAM). A sharded tensor is split by rows (dim 0) as FSDP2 does, its rows padded to a
multiple of p, so the sharded terms use Ψ_pad = Σ ceil(rows/p)·p·(elements per row) instead of Ψ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from ..costs.hardware import STATE_BYTES_PER_PARAM

SCHEMES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2")
CATEGORIES = ("params", "grads", "optimizer")
# which categories each scheme shards over the ranks (ZeRO paper, figure 1: P_os, P_os+g, P_os+g+p)
SHARDED = {"DP": (), "ZeRO-1": ("optimizer",), "ZeRO-2": ("grads", "optimizer"),
           "ZeRO-3": CATEGORIES, "FSDP2": CATEGORIES}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor behind a DTensor (FSDP2's sharded parameters and gradients), else t itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of memory behind these tensors: each distinct storage counted once, with its full size (padding and
    views included, the way the allocator sees them)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure(params, grads, optimizer) -> dict:
    """{"params", "grads", "optimizer", "total"}: held_bytes of each group of tensors this rank holds."""
    out = {"params": held_bytes(params), "grads": held_bytes(grads), "optimizer": held_bytes(optimizer)}
    out["total"] = sum(out.values())
    return out


def padded_rows(rows: int, p: int) -> int:
    """Rows after padding to a multiple of p (FSDP2 pads dim 0 so every rank's shard has ceil(rows/p) rows)."""
    return math.ceil(rows / p) * p


def numel(shapes: Sequence[Sequence[int]]) -> int:
    """Ψ: the number of parameters."""
    return sum(math.prod(s) for s in shapes)


def padded_numel(shapes: Sequence[Sequence[int]], p: int) -> int:
    """Ψ_pad: parameters once every tensor's rows are padded to a multiple of p (= Ψ when p divides every dim 0)."""
    return sum(padded_rows(s[0], p) * math.prod(s[1:]) for s in shapes)


def per_rank_bytes(scheme: str, shapes: Sequence[Sequence[int]] | float, p: int, precision: str = "fp32") -> dict:
    """Bytes one rank holds per category under `scheme` (ZeRO paper, figure 1 / section 5), and the total.

    `shapes` is the list of parameter shapes (exact, padding counted) or a parameter count (no padding: the
    paper's Ψ, e.g. 7.5e9 or 175e9)."""
    if scheme not in SHARDED:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    per = STATE_BYTES_PER_PARAM[precision]
    psi, psi_pad = (shapes, shapes) if isinstance(shapes, int | float) else (numel(shapes), padded_numel(shapes, p))
    bytes_per = {"params": per["weights"], "grads": per["gradients"], "optimizer": per["optimizer"]}
    out = {c: bytes_per[c] * (psi_pad // p if isinstance(psi_pad, int) else psi_pad / p) if c in SHARDED[scheme]
           else bytes_per[c] * psi for c in CATEGORIES}
    out["total"] = sum(out.values())
    return out


def pad_bytes(scheme: str, shapes: Sequence[Sequence[int]], p: int, precision: str = "fp32") -> int:
    """Bytes of padding rows summed over all p ranks (they sit on the last ranks): (Ψ_pad - Ψ) x the bytes per
    parameter of the categories the scheme shards."""
    per = STATE_BYTES_PER_PARAM[precision]
    bytes_per = {"params": per["weights"], "grads": per["gradients"], "optimizer": per["optimizer"]}
    return (padded_numel(shapes, p) - numel(shapes)) * sum(bytes_per[c] for c in SHARDED[scheme])
