"""The most memory a function's tensors held at once, beyond what existed before it ran, and the largest single
tensor it made (notebook 15b).

On a GPU: torch.cuda's allocator statistics (max_memory_allocated after reset_peak_memory_stats). On the CPU, which
keeps no such statistics: torch's profiler (torch.autograd.profiler.profile, the one torch.profiler.profile wraps)
with profile_memory records every allocation and free, and its memory timeline (the one `export_memory_timeline`
draws; torch.profiler._memory_profiler, private but present since torch 2.1 and checked by
tests/test_ring_attention.py) replays them in order; the largest running total is the peak. Tensors that existed
before the call are not counted.

LargestTensor reads every operation's result at the dispatcher (any device, no profiler): a checker uses it to see
whether a learner's ring attention ever built a tensor bigger than one block of scores, as gathering every rank's
keys or a whole row of scores does, and how many multiply-adds its matrix products did (a block computed whole and
masked does twice the half-block kernel's). torch.utils.flop_counter counts the same ops, but its first use imports
torch._dynamo, seconds per rank.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def peak_bytes(fn, device: torch.device | str = "cpu"):
    """(fn(), the peak bytes of tensors allocated while fn ran and alive at the same moment). On a GPU fn runs twice,
    the first time so that one-time workspaces (cuBLAS's) exist before measuring: call it on every rank alike."""
    device = torch.device(device)
    if device.type == "cuda":
        fn()
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - base
    from torch.autograd.profiler import profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    # The profiler torch.profiler.profile wraps, and the timeline its _memory_profile() builds from it: the wrapper's
    # start asks hasattr(torch, "_inductor"), which imports torch._inductor and torch._dynamo (seconds per rank).
    with profile(use_kineto=True, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        out = fn()
    live = peak = 0
    for _, action, _, size in MemoryProfile(prof.kineto_results).timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return out, peak


def _bytes(t: torch.Tensor) -> int:
    """Bytes a result occupies: its elements, or its storage when that is smaller (an expanded view repeats one
    row without storing it again)."""
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):      # a tensor without storage (meta, sparse)
        return n


def _macs(name: str, args) -> int:
    """Multiply-adds of one matrix-product or fused-attention operator (0 for any other): mm (m x k @ k x n) and
    addmm: m k n; bmm and baddbmm: b m k n; mv and addmv: m k; dot: n; scaled_dot_product_* (batch, heads, L, d):
    q k^T and p v, 2 L S d per batch and head, whatever the mask (a fused kernel may skip masked tiles; this counts
    what was asked for)."""
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
        return a.numel() * b.shape[-1]
    if name in ("mv", "addmv"):                       # matrix x vector: one row of scores at a time counts too
        return (args[0] if name == "mv" else args[1]).numel()
    if name in ("dot", "vdot"):
        return args[0].numel()
    if name.startswith("_scaled_dot_product_") and "backward" not in name:
        q, k = args[0], args[1]
        return 2 * q.numel() * k.shape[-2]
    return 0


class LargestTensor(TorchDispatchMode):
    """`with LargestTensor() as big:` the largest tensor any operation in the block produced (big.bytes, big.shape,
    big.op) and the multiply-adds of its matrix products and fused attentions (big.macs). Communication operators
    (c10d) are left out: they fill buffers the caller made."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False          # the default wrapper imports torch._dynamo (seconds per rank); nothing here compiles

    def __init__(self):
        super().__init__()
        self.bytes, self.shape, self.op, self.macs = 0, (), None, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.macs += _macs(func.overloadpacket.__name__, args)
        out = func(*args, **(kwargs or {}))
        if func.namespace not in ("c10d", "_c10d_functional"):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and _bytes(t) > self.bytes:
                    self.bytes, self.shape, self.op = _bytes(t), tuple(t.shape), str(func.overloadpacket)
        return out
