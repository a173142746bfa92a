"""One record per c10d operator a rank calls: the dispatch mode that CommLog, AllToAllLog and Watch read.

Every road to a collective or a message (``dist.*``, the ProcessGroup object, torch's functional collectives, DTensor,
FSDP2) ends in a dispatcher operator of c10d_ops.py, where a TorchDispatchMode sees it. The Recorder turns each call
into one Event: a collective or a message, its operator and collective, S as nccl-tests counts it (notebook 05), the
group's size, a message's peer and bytes (06), the reduce op and elements a checker compares, and an all-to-all's
bytes to and from each rank with the road it took (15). comm_log.py, alltoall_log.py and checks/watch.py are views
of these events; collective_calls.py enters the Recorder around each call it wraps, on whichever thread makes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .c10d_ops import OP_TO_COLLECTIVE, RECVS, SENDS, group_of, nbytes, op_key, size_of

ALL_TO_ALL_SINGLE = ("c10d.alltoall_base_", "_c10d_functional.all_to_all_single")


@dataclass
class Event:
    """One c10d operator call of this rank, as the Recorder saw it."""

    kind: str                      # "collective", "send" or "recv"
    op: str                        # the dispatcher operator, "c10d.allreduce_"
    collective: str                # its name in c10d_ops.COLLECTIVES: "all_gather_single", "send_recv", ...
    p: int                         # ranks in the group
    ranks: list[int] | None = None  # the group's members, global ranks
    size: int | None = None        # S in bytes as nccl-tests counts it; None: not a size-S collective
    nbytes: int = 0                # a message's payload; a collective's largest tensor argument (a list: all of it)
    numel: int = 0                 # the largest tensor argument (a message: its payload), in elements
    reduce_op: str | None = None   # "SUM", "MAX", ... for a collective that reduces
    peer: int | None = None        # a message's other end, a global rank (-1: any source)
    to: list[int] | None = None    # an all_to_all_single's bytes to each rank of the group (index = group rank)
    frm: list[int] | None = None   # and from each
    rank: int | None = None        # this rank in the group (in an all-to-all its own share is a local copy)
    via: str = "c10d"              # "c10d": the c10d operators; "functional": torch's functional collectives


def _reduce_op(args) -> str | None:
    """'SUM', 'MAX', 'AVG', ... for a collective that reduces."""
    for a in args:
        if isinstance(a, str) and a.upper() in dist.ReduceOp.RedOpType.__members__:   # functional: all_reduce(x, "sum")
            return a.upper()
        if isinstance(a, torch.ScriptObject) and "ReduceOp" in str(a._type()):
            value = a.op()
            try:
                return dist.ReduceOp.RedOpType(value).name
            except (TypeError, ValueError):
                return str(value).rsplit(".", 1)[-1]
    return None


def _numel(t) -> int:
    """Elements of a tensor, or of the tensors in a (nested) list together: what c10d_ops.nbytes counts, in elements."""
    if isinstance(t, torch.Tensor):
        return t.numel()
    return sum(_numel(x) for x in t) if isinstance(t, list | tuple) else 0


def _global(group, peer):
    """A peer's rank in the world, from its rank in the group the message went through."""
    if group is None or peer is None or peer < 0:
        return peer
    try:
        return dist.get_global_rank(group, peer) if group.size() != dist.get_world_size() else peer
    except (RuntimeError, ValueError):
        return peer


def _rows(t: torch.Tensor, splits: list[int], p: int) -> list[int]:
    """Rows to or from each rank: the split sizes given, or equal splits when the list is empty."""
    if splits:
        return [int(s) for s in splits]
    n = t.shape[0] if t.dim() else 1
    return [n // p] * p


def _row_bytes(t: torch.Tensor) -> int:
    n = t.shape[0] if t.dim() else 1
    return (t.numel() // max(n, 1)) * t.element_size()


def _per_peer(key: str, args, p: int) -> tuple[list[int], list[int]]:
    """Bytes an all_to_all_single sends to and receives from each rank, read from what the backend was asked."""
    if key == "c10d.alltoall_base_":
        # schema: (output, input, process_group, output_split_sizes, input_split_sizes, async_op, timeout)
        out, inp, _, out_splits, in_splits = args[:5]
        return ([r * _row_bytes(inp) for r in _rows(inp, list(in_splits), p)],
                [r * _row_bytes(out) for r in _rows(out, list(out_splits), p)])
    # schema: (input, output_split_sizes, input_split_sizes, group_name); the output is what it returns
    inp, out_splits, in_splits = args[:3]
    row = _row_bytes(inp)
    return [int(r) * row for r in in_splits], [int(r) * row for r in out_splits]


def event(func, args, kwargs) -> Event | None:
    """The Event of one operator call; None for an operator that is no collective or message (aten, barrier)."""
    key = op_key(func)
    if key not in OP_TO_COLLECTIVE:
        return None
    via = "c10d" if key.startswith("c10d.") else "functional"
    message = key in SENDS or key in RECVS
    group = group_of(args) if message else group_of(list(args) + list(kwargs.values()))
    p = group.size() if group is not None else dist.get_world_size()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(p))
    tensors = [a for a in args if isinstance(a, torch.Tensor | list)]
    numel = max((_numel(t) for t in tensors), default=0)
    if message:
        payload = args[0] if args else kwargs.get("tensors", kwargs.get("input"))
        ints = [a for a in args[1:] if isinstance(a, int) and not isinstance(a, bool)]
        peer = -1 if key == "c10d.recv_any_source_" else _global(group, ints[0] if ints else None)
        return Event("send" if key in SENDS else "recv", key, "send_recv", p, ranks, nbytes=nbytes(payload),
                     numel=numel, peer=peer, rank=dist.get_rank(group), via=via)
    seen = Event("collective", key, OP_TO_COLLECTIVE[key], p, ranks, size=size_of(key, tensors, p),
                 nbytes=max((nbytes(t) for t in tensors), default=0), numel=numel, reduce_op=_reduce_op(args),
                 rank=dist.get_rank(group), via=via)
    if key in ALL_TO_ALL_SINGLE:
        seen.to, seen.frm = _per_peer(key, args, p)
    return seen


class Recorder(TorchDispatchMode):
    """`with Recorder() as rec:` appends an Event to rec.events for each c10d operator this rank calls in the block.
    The views read events with plain functions (comm_log.calls_of, alltoall_log.exchanges_of), so one recording
    serves them all and a view never records into another's list."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False          # the default wrapper imports torch._dynamo (seconds per rank); nothing here compiles

    def __init__(self):
        super().__init__()
        self.events: list[Event] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = event(func, args, kwargs)   # read before the call, as the caller passed them
        out = func(*args, **kwargs)
        if seen is not None:               # after it: a call that raised (one switched off) moved nothing
            self.events.append(seen)
            self.recorded(seen, out, args)
        return out

    def recorded(self, seen: Event, out, args) -> None:
        """Called with each new event, what its operator returned and its arguments (Watch follows a message's Work;
        exercise 9.2's checker notes which storage an all-reduce reduced)."""
