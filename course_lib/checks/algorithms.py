"""Checker for the ring all-reduce exercise of notebooks/06_build_your_own_collectives.ipynb.

Runs the learner's function on real ranks against torch's own dist.all_reduce (course_lib.checks.core), on world
sizes 1-5, tensor sizes smaller than, equal to and not divisible by the world size, and integer and float dtypes.
"""

from __future__ import annotations

import torch

from .core import check_collective

RING_HINT = (
    "Split the flattened tensor into p chunks with torch.tensor_split (sizes may differ by one; some may be empty). "
    "Reduce-scatter: p-1 steps, at step s send chunk (rank - s) % p to rank+1 and add what rank-1 sends into chunk "
    "(rank - s - 1) % p. All-gather: p-1 more steps passing the finished chunks on, copying instead of adding. "
    "Post the send and the receive together (dist.isend + dist.irecv, then wait both) or the ring deadlocks, "
    "receive into a separate buffer before adding, and skip empty chunks on both sides."
)


def _make_input(rank: int, world: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Different values on every rank and element, so a chunk added twice or not at all shows."""
    base = torch.arange(size, dtype=torch.float64) * (world + 1) + rank * 10 + 1
    if dtype.is_floating_point:
        return (base / 7).to(dtype)
    return base.to(dtype)


def _torch_all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def _returns_tensor(learner):
    """The learner's function may return the tensor or work in place and return None: compare the tensor."""
    def run_it(x):
        out = learner(x)
        return x if out is None else out
    return run_it


def check_ring_all_reduce(learner, world_sizes=(1, 2, 3, 4, 5), sizes=(1, 4, 7, 12),
                          dtypes=(torch.float32, torch.int64)) -> str:
    """Exercise 6.1: `learner(tensor)` must leave (or return) the sum over ranks, like dist.all_reduce."""
    return check_collective("Exercise 6.1 (ring all-reduce)", _returns_tensor(learner), _torch_all_reduce,
                            _make_input, world_sizes=world_sizes, sizes=sizes, dtypes=dtypes, hint=RING_HINT)
