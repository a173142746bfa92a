"""Which collectives this rank called, on how many bytes, and what a ring sends for them (notebooks 12 and 13).

CommLog sees every collective a rank runs, whether the caller is our code, FSDP2 (`fully_shard`) or DTensor:
all of them end in the c10d operators (`c10d.allreduce_`, `c10d._allgather_base_`, ...) or the functional ones
(`_c10d_functional.all_reduce`, ...), which recorder.py's dispatch mode intercepts; CommLog is a view of its events.
Sizes follow nccl-tests: an all-reduce or broadcast of S bytes, an all-gather whose *result* is S bytes, a
reduce-scatter whose *input* is S bytes.
"Ring bytes" are what each rank sends under the bandwidth-optimal ring algorithms (Patarasuk & Yuan 2009; ZeRO,
Rajbhandari et al. SC'20, section 7): all-reduce 2(p-1)/p S, all-gather and reduce-scatter (p-1)/p S each.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .c10d_ops import family
from .recorder import Recorder

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


def calls_of(events) -> list[Call]:
    """The sized collectives among recorder.py's events, in the order they ran (point-to-point messages are not:
    checks/watch.py counts them)."""
    return [Call(family(e.collective), e.size, e.p) for e in events if e.size is not None]


class CommLog(Recorder):
    """`with CommLog() as log:` records every collective this rank runs in the block (log.calls)."""

    @property
    def calls(self) -> list[Call]:
        return calls_of(self.events)

    def summary(self) -> dict:
        """{collective: {"calls", "bytes" (sum of S), "ring_bytes" (sent by this rank)}}, plus a "total" row."""
        out = defaultdict(lambda: {"calls": 0, "bytes": 0, "ring_bytes": 0.0})
        for c in self.calls:
            for key in (c.op, "total"):
                out[key]["calls"] += 1
                out[key]["bytes"] += c.size
                out[key]["ring_bytes"] += c.ring_bytes
        return dict(out)
