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

from .c10d_ops import OP_TO_COLLECTIVE, family, group_of, op_key, size_of

# bytes one rank sends under the ring algorithm, as a multiple of (p-1)/p * S
# (gather and scatter: the busiest rank of a chain to or from the root passes on p-1 of the p pieces)
RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "gather": 1, "scatter": 1}


@dataclass
class Call:
    op: str            # all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, gather, scatter
    size: int          # S in bytes, as nccl-tests counts it
    p: int             # ranks in the group

    @property
    def ring_bytes(self) -> float:
        """Bytes a rank sends under the ring algorithm (broadcast and reduce: S, a pipelined chain; gather and
        scatter: the busiest rank of a chain, not this one: sent directly, a non-root sends S/p and the root none)."""
        if self.p == 1:
            return 0.0
        if self.op in RING_FACTOR:
            return RING_FACTOR[self.op] * (self.p - 1) / self.p * self.size
        return float(self.size)


class CommLog(TorchDispatchMode):
    """`with CommLog() as log:` records every collective this rank runs in the block (log.calls)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False          # the default wrapper imports torch._dynamo (seconds per rank); nothing here compiles

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_key(func)
        if name in OP_TO_COLLECTIVE:
            group = group_of(list(args) + list(kwargs.values()))
            p = group.size() if group is not None else dist.get_world_size()
            size = size_of(name, [a for a in args if isinstance(a, torch.Tensor | list)], p)
            if size is not None:  # point-to-point messages are not collectives: checks/traffic.py counts them
                self.calls.append(Call(family(OP_TO_COLLECTIVE[name]), size, p))
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
