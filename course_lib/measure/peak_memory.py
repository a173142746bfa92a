"""The most memory a function's tensors held at once, beyond what existed before it ran (notebook 15).

On a GPU: torch.cuda's allocator statistics (max_memory_allocated after reset_peak_memory_stats). On the CPU, which
keeps no such statistics: torch.profiler with profile_memory records every allocation and free, and its memory
timeline (the one `export_memory_timeline` draws; torch.profiler._memory_profiler, private but present since
torch 2.1 and checked by tests/test_ring_attention.py) replays them in order; the largest running total is the
peak. Tensors that existed before the call are not counted.
"""

from __future__ import annotations

import torch


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
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        out = fn()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return out, peak
