"""One intra-op thread for the small single-process references of notebook 11 (and anything else this small).

The course's MLP is too small for torch's intra-op threads to help: they mostly wait on each other, and on a loaded
machine whose cores the ranks also need they make a step many times slower (measured on a 2-vCPU machine at load
average 13: train_single for 4 workers and 10 steps took 9.7 s with 2 threads, 0.4 s with 1).
"""

from __future__ import annotations

import functools

import torch


def single_threaded(fn):
    """Run `fn` with torch.set_num_threads(1), restoring the caller's thread count after."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return wrapper
