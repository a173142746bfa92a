"""Which collectives this rank called, on how many bytes, and what a ring sends for them (notebooks 12 and 13).

CommLog sees every collective a rank runs, whether the caller is our code, FSDP2 (`fully_shard`) or DTensor:
all of them end in the c10d operators (`c10d.allreduce_`, `c10d._allgather_base_`, ...) or the functional ones
(`_c10d_functional.all_reduce`, ...), which a TorchDispatchMode intercepts. Sizes follow nccl-tests: an all-reduce
or broadcast of S bytes, an all-gather whose *result* is S bytes, a reduce-scatter whose *input* is S bytes.
"Ring bytes" are what each rank sends under the bandwidth-optimal ring algorithms (Patarasuk & Yuan 2009; ZeRO,
Rajbhandari et al. SC'20, section 7): all-reduce 2(p-1)/p S, all-gather and reduce-scatter (p-1)/p S each.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# operator name (without overload) -> (collective, which tensor argument holds the full size S)
_OPS = {
    "c10d.allreduce_": ("all_reduce", "first"),
    "c10d.broadcast_": ("broadcast", "first"),
    "c10d.reduce_": ("reduce", "first"),
    "c10d.allgather_": ("all_gather", "out_list"),
    "c10d._allgather_base_": ("all_gather", "first"),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", "first"),
    "c10d.reduce_scatter_": ("reduce_scatter", "in_list"),
    "c10d._reduce_scatter_base_": ("reduce_scatter", "second"),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", "second"),
    "c10d.alltoall_base_": ("all_to_all", "first"),
    "_c10d_functional.all_reduce": ("all_reduce", "input"),
    "_c10d_functional.all_reduce_": ("all_reduce", "input"),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", "input_times_p"),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_c10d_functional.broadcast": ("broadcast", "input"),
    "_c10d_functional.all_to_all_single": ("all_to_all", "input"),
}

# bytes one rank sends under the ring algorithm, as a multiple of (p-1)/p * S
RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}


def _bytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return sum(_bytes(x) for x in t)


def _group_size(args) -> int:
    """Size of the process group the operator runs on (the world when it cannot be told)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except RuntimeError:       # the ReduceOp or options object, not the group
                continue
    for a in args:
        if isinstance(a, str):
            try:
                return dist.distributed_c10d._resolve_process_group(a).size()
            except (RuntimeError, ValueError, KeyError):
                continue
    return dist.get_world_size()


@dataclass
class Call:
    op: str            # all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all
    size: int          # S in bytes, as nccl-tests counts it
    p: int             # ranks in the group

    @property
    def ring_bytes(self) -> float:
        """Bytes this rank sends for the call under the ring algorithm (broadcast and reduce: S, a pipelined chain)."""
        if self.p == 1:
            return 0.0
        if self.op in RING_FACTOR:
            return RING_FACTOR[self.op] * (self.p - 1) / self.p * self.size
        return float(self.size)


class CommLog(TorchDispatchMode):
    """`with CommLog() as log:` records every collective this rank runs in the block (log.calls)."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func.namespace}.{func.__name__.split('.')[0]}"
        if name in _OPS:
            op, where = _OPS[name]
            p = _group_size(list(args) + list(kwargs.values()))
            tensors = [a for a in args if isinstance(a, torch.Tensor | list)]
            size = {"first": lambda: _bytes(tensors[0]), "second": lambda: _bytes(tensors[1]),
                    "input": lambda: _bytes(tensors[0]), "input_times_p": lambda: _bytes(tensors[0]) * p,
                    "out_list": lambda: _bytes(tensors[0][0]) if tensors[0] and isinstance(tensors[0][0], list)
                    else _bytes(tensors[0]),
                    "in_list": lambda: _bytes(tensors[1][0]) if tensors[1] and isinstance(tensors[1][0], list)
                    else _bytes(tensors[1])}[where]()
            self.calls.append(Call(op, size, p))
        return func(*args, **kwargs)

    def summary(self) -> dict:
        """{collective: {"calls", "bytes" (sum of S), "ring_bytes" (sent by this rank)}}, plus a "total" row."""
        out = defaultdict(lambda: {"calls": 0, "bytes": 0, "ring_bytes": 0.0})
        for c in self.calls:
            for key in (c.op, "total"):
                out[key]["calls"] += 1
                out[key]["bytes"] += c.size
                out[key]["ring_bytes"] += c.ring_bytes
        return dict(out)
