"""Bytes this rank sent to and received from every peer in each all-to-all, as the backend was asked (notebook 15).

`dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes)` ends in the c10d operator
`c10d.alltoall_base_` (gloo and NCCL alike), whose arguments are exactly what the backend moves: rows
`input_split_sizes[j]` of `inp` go to rank j, rows `output_split_sizes[j]` of `out` come from rank j (empty lists:
equal splits). A TorchDispatchMode reads them there, so what the learner's cell passed is measured, not assumed.
The rows a rank "sends" to itself are a local copy and are kept apart from the bytes that cross a link.
torch's functional all-to-all (`_functional_collectives.all_to_all_single`, differentiable in torch 2.13, and what
`all_to_all_single_autograd` calls) ends in `_c10d_functional.all_to_all_single` instead; it is logged too, marked
`via="functional"`, so a checker can tell which road a learner's exchange took.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def _rows(t: torch.Tensor, splits: list[int], p: int) -> list[int]:
    if splits:
        return [int(s) for s in splits]
    n = t.shape[0] if t.dim() else 1
    return [n // p] * p


def _row_bytes(t: torch.Tensor) -> int:
    n = t.shape[0] if t.dim() else 1
    return (t.numel() // max(n, 1)) * t.element_size()


@dataclass
class Exchange:
    """One all-to-all seen from this rank: bytes to each peer (index = rank), bytes from each peer."""

    to: list[int]
    frm: list[int]
    rank: int
    via: str = "c10d"          # "c10d": dist.all_to_all_single; "functional": torch's functional collective

    @property
    def sent(self) -> int:
        """Bytes that left this rank for other ranks (its own share is a local copy, not counted)."""
        return sum(b for j, b in enumerate(self.to) if j != self.rank)

    @property
    def received(self) -> int:
        return sum(b for j, b in enumerate(self.frm) if j != self.rank)


class AllToAllLog(TorchDispatchMode):
    """`with AllToAllLog() as log:` records every all_to_all_single of this rank in the block (log.calls)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False          # the default wrapper imports torch._dynamo (seconds per rank); nothing here compiles

    def __init__(self):
        super().__init__()
        self.calls: list[Exchange] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func.namespace}.{func.__name__.split('.')[0]}"
        if name == "c10d.alltoall_base_":
            # schema: (output, input, process_group, output_split_sizes, input_split_sizes, async_op, timeout)
            out, inp, group, out_splits, in_splits = args[:5]
            group = dist.ProcessGroup.unbox(group)
            p, rank = group.size(), group.rank()
            out_splits, in_splits = list(out_splits), list(in_splits)
            to = [r * _row_bytes(inp) for r in _rows(inp, in_splits, p)]
            frm = [r * _row_bytes(out) for r in _rows(out, out_splits, p)]
            self.calls.append(Exchange(to, frm, rank))
        elif name == "_c10d_functional.all_to_all_single":
            # schema: (input, output_split_sizes, input_split_sizes, group_name); the output is what it returns
            inp, out_splits, in_splits, group_name = args[:4]
            group = dist.distributed_c10d._resolve_process_group(group_name)
            row = _row_bytes(inp)
            self.calls.append(Exchange([int(r) * row for r in in_splits], [int(r) * row for r in out_splits],
                                       group.rank(), via="functional"))
        return func(*args, **kwargs)

    @property
    def sent(self) -> int:
        """Bytes this rank sent to other ranks over all logged all-to-alls."""
        return sum(c.sent for c in self.calls)

    @property
    def received(self) -> int:
        return sum(c.received for c in self.calls)
