"""Activation memory: the bytes autograd keeps for backward, counted from saved-tensor hooks (notebook 14b).

`ActivationMeter` sees every tensor an op saves for its backward (torch.autograd.graph.saved_tensors_hooks) and
holds it in a small object whose deletion tells the meter the tensor was released, so `live` and `peak` follow what
autograd really keeps, storage by storage (a tensor saved by two ops, like a ReLU's output that the next Linear
also saves, is counted once). Parameters, and views or casts of them (autocast's bf16 copy of a weight), are not
activations and are left out (casts are counted apart). Formulas: the course's MLP (each Linear keeps its input,
each ReLU its output) and a transformer layer, s·b·h·(34 + 5·a·s/h) bytes in 16-bit (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4.1, equation 1), built by
`TransformerLayer` below.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# grad_fn names through which a saved tensor may still be a parameter (a transpose, a view, autocast's cast)
_PARAM_PATH = {"TBackward0", "ToCopyBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
               "ExpandBackward0", "UnsqueezeBackward0", "ReshapeAliasBackward0"}


def parameter_kind(t: torch.Tensor) -> str | None:
    """"parameter" for an nn.Parameter or a view of one (what a Linear saves as its weight), "cast" for a copy of
    one in another dtype (autocast's 16-bit weight), None for anything else (an activation)."""
    if isinstance(t, nn.Parameter):
        return "parameter"
    fn, cast = t.grad_fn, False
    while fn is not None and fn.name() in _PARAM_PATH:
        cast = cast or fn.name() == "ToCopyBackward0"
        fn = fn.next_functions[0][0]
    if fn is not None and type(fn).__name__ == "AccumulateGrad" and isinstance(fn.variable, nn.Parameter):
        return "cast" if cast else "parameter"
    return None


class _Held:
    """What autograd stores instead of the tensor: releasing it (after backward) releases the meter's count."""

    __slots__ = ("t", "meter", "key")

    def __init__(self, t, meter, key):
        self.t, self.meter, self.key = t, meter, key

    def __del__(self):
        self.meter._release(self.key)


class ActivationMeter:
    """`with meter:` around a forward: `meter.live` bytes of activations saved for backward and not yet released,
    `meter.peak` the most at any time, `meter.records` [(label, dtype, bytes)] per distinct storage (label =
    meter.label); `meter.casts` bytes of 16-bit weight copies saved (autocast), counted apart."""

    def __init__(self):
        self.live = self.peak = self.casts = 0
        self._cast_seen: set[int] = set()
        self.label = ""
        self.records: list[tuple[str, torch.dtype, int]] = []
        self._refs: dict[int, int] = defaultdict(int)
        self._size: dict[int, int] = {}
        self._hooks = None

    def _pack(self, t):
        kind = parameter_kind(t)
        if kind == "cast" and t.untyped_storage().data_ptr() not in self._cast_seen:
            self._cast_seen.add(t.untyped_storage().data_ptr())
            self.casts += t.untyped_storage().nbytes()
        if kind is not None:
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if self._refs[key] == 0:
            self._size[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            self.records.append((self.label, t.dtype, storage.nbytes()))
        self._refs[key] += 1
        # a detached view of the same storage: the tensor itself would tie its own grad_fn (which holds this _Held)
        # in a cycle gc cannot see through C++, kept alive by a graph dropped without a backward
        return _Held(t.detach(), self, key)

    @staticmethod
    def _unpack(h):
        return h.t if isinstance(h, _Held) else h

    def _release(self, key):
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live -= self._size.pop(key)
            del self._refs[key]

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False


def saved_by_layer(model: nn.Sequential, x: torch.Tensor) -> tuple[list[tuple[str, int]], int]:
    """Forward `model` on x with a meter: [(layer name, bytes of storages first saved by that layer)] and the
    total kept for backward (distinct storages). The graph is freed before returning."""
    meter = ActivationMeter()
    out = x
    with meter:
        for name, layer in model.named_children():
            meter.label = f"{name}: {type(layer).__name__}"
            out = layer(out)
    per: dict[str, int] = defaultdict(int)
    for label, _, nbytes in meter.records:
        per[label] += nbytes
    rows = [(f"{n}: {type(la).__name__}", per[f"{n}: {type(la).__name__}"]) for n, la in model.named_children()]
    total = meter.live
    del out
    return rows, total


def mlp_activation_formula(model: nn.Sequential, batch: int, bytes_per: int = 4) -> list[int]:
    """Bytes each layer adds to what backward keeps: a Linear its input (batch x in_features) when nothing before
    it kept that tensor (only the first), a ReLU its output (batch x width), which the next Linear reuses."""
    rows, width, kept_input = [], None, False
    for layer in model:
        if isinstance(layer, nn.Linear):
            rows.append(0 if kept_input else batch * layer.in_features * bytes_per)
            width, kept_input = layer.out_features, False
        elif isinstance(layer, nn.ReLU):
            rows.append(batch * width * bytes_per)
            kept_input = True
        else:
            raise ValueError(f"no formula for {type(layer).__name__}")
    return rows


def transformer_formula(s: int, b: int, h: int, a: int) -> dict:
    """Korthikanti et al. 2022, section 4.1, 16-bit activations and 1-byte dropout masks: attention 11sbh + 5as²b,
    MLP 19sbh, two LayerNorms 4sbh; total sbh(34 + 5as/h)."""
    out = {"attention": 11 * s * b * h + 5 * a * s * s * b, "mlp": 19 * s * b * h, "layernorms": 4 * s * b * h}
    out["total"] = sum(out.values())
    assert out["total"] == s * b * h * (34 + 5 * a * s / h)
    return out


class TransformerLayer(nn.Module):
    """A GPT layer as the paper counts it (Megatron-LM's: pre-LayerNorm, attention with softmax dropout, 4h MLP with
    GeLU, dropout before each residual add). Input and output are s x b x h (sequence first)."""

    def __init__(self, h: int, a: int, dropout: float = 0.1):
        super().__init__()
        self.a, self.d = a, h // a
        self.ln1, self.qkv, self.proj = nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.drop = nn.Dropout(dropout)

    def attention(self, x):
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b * self.a, 3 * self.d).transpose(0, 1).chunk(3, dim=-1)
        scores = torch.bmm(q, k.transpose(1, 2)) * (1 / math.sqrt(self.d))     # (b·a, s, s)
        probs = self.drop(torch.softmax(scores, dim=-1))
        context = torch.bmm(probs, v).transpose(0, 1).reshape(s, b, h)
        return x + self.drop(self.proj(context))

    def forward(self, x):
        x = self.attention(x)
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)))))


def beyond_formula(s: int, b: int, h: int, a: int, dtype: torch.dtype, device="cpu") -> dict:
    """What a TransformerLayer keeps beyond the paper's count, probed with this torch build on tiny inputs on
    `device`: each LayerNorm's mean and 1/std (s·b values each, two LayerNorms; the paper leaves them out as small,
    section 4: 2sb against sbh), and the dropout masks at `mask_bytes` per element where the paper counts 1 (three
    masks: a·s²·b + 2·s·b·h elements). On a CPU torch runs dropout as input x noise and keeps the noise, a tensor of
    the activation's dtype (2 bytes in bf16); CUDA's fused native_dropout keeps a 1-byte bool mask."""
    with ActivationMeter() as meter:          # the outputs stay alive (assigned) so their graphs keep what they saved
        kept = nn.functional.dropout(torch.ones(64, dtype=dtype, device=device, requires_grad=True), 0.5,
                                     training=True)
        mask_bytes = meter.live // 64
    x = torch.ones(4, 8, dtype=dtype, device=device, requires_grad=True)
    with ActivationMeter() as meter:
        kept = nn.functional.layer_norm(x, (8,))
        stats_per_row = (meter.live - x.untyped_storage().nbytes()) // 4
    del kept
    out = {"mask_bytes": mask_bytes, "masks": (mask_bytes - 1) * (a * s * s * b + 2 * s * b * h),
           "layernorm_stats": 2 * s * b * stats_per_row}
    out["total"] = out["masks"] + out["layernorm_stats"]
    return out


class KeptBytes(TorchDispatchMode):
    """`with KeptBytes() as k:` around a forward; `k.bytes(exclude)`: storages its ops made that are still alive
    (what selective checkpointing keeps out of sight of saved-tensor hooks; notebook 14b)."""

    def __init__(self):
        super().__init__()
        self._made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._made += [weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out

    def bytes(self, exclude=()) -> int:
        """Distinct live storages, less those of `exclude` (the input, the output, the parameters and their views)."""
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        live = {}
        for ref in self._made:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() not in skip:
                live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(live.values())


class LiveBytes(KeptBytes):
    """`with LiveBytes() as m:` around a training step (forward and backward): `m.timeline[i]` is the bytes of the
    storages made inside the block and still alive after its i-th op (activations, recomputed ones, temporaries and
    gradients; parameters and the step's input were made before). `m.mark()` returns the index of the next op, e.g.
    where forward ends (notebook 14b's memory timeline)."""

    def __init__(self):
        super().__init__()
        self.timeline: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._made = [ref for ref in self._made if ref() is not None]     # forget the dead: each op scans only the live
        self.timeline.append(self.bytes())
        return out

    def mark(self) -> int:
        return len(self.timeline)


def kept_for_backward(forward, params, name_of=lambda t: "activation") -> tuple:
    """forward()'s output and {name_of(tensor): bytes} of what autograd saved for backward: each storage once, the
    parameters' left out, a DTensor counted by its local shard (notebooks 12 and 13's count)."""
    weights = {q.untyped_storage().data_ptr() for q in params}
    saved = {}

    def pack(t):
        s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if s.data_ptr() not in weights:
            saved[s.data_ptr()] = (name_of(t), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    kept = defaultdict(int)
    for name, nbytes in saved.values():
        kept[name] += nbytes
    return out, dict(kept)
