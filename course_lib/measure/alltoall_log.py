"""Bytes this rank sent to and received from every peer in each all-to-all, as the backend was asked (notebook 15).

`dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes)` ends in the c10d operator
`c10d.alltoall_base_` (gloo and NCCL alike), whose arguments are exactly what the backend moves: rows
`input_split_sizes[j]` of `inp` go to rank j, rows `output_split_sizes[j]` of `out` come from rank j (empty lists:
equal splits). recorder.py's dispatch mode reads them there, so what the learner's cell passed is measured, not
assumed; AllToAllLog is a view of its events.
The rows a rank "sends" to itself are a local copy and are kept apart from the bytes that cross a link.
torch's functional all-to-all (`_functional_collectives.all_to_all_single`, differentiable in torch 2.13, and what
`all_to_all_single_autograd` calls) ends in `_c10d_functional.all_to_all_single` instead; it is logged too, marked
`via="functional"`, so a checker can tell which road a learner's exchange took.
"""

from __future__ import annotations

from dataclasses import dataclass

from .recorder import Recorder


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


def exchanges_of(events) -> list[Exchange]:
    """The all_to_all_single calls among recorder.py's events."""
    return [Exchange(e.to, e.frm, e.rank, e.via) for e in events if e.to is not None]


class AllToAllLog(Recorder):
    """`with AllToAllLog() as log:` records every all_to_all_single of this rank in the block (log.calls)."""

    @property
    def calls(self) -> list[Exchange]:
        return exchanges_of(self.events)

    @property
    def sent(self) -> int:
        """Bytes this rank sent to other ranks over all logged all-to-alls."""
        return sum(c.sent for c in self.calls)

    @property
    def received(self) -> int:
        return sum(c.received for c in self.calls)
