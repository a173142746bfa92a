"""The one point-to-point step every course algorithm is built from (isend/irecv only), with per-rank byte counts.

Taught in notebooks/06_build_your_own_collectives.ipynb. Point-to-point = between two processes; the collectives
in this package are made of nothing else, so their traffic can be counted exactly and compared with the formulas
in course_lib.costs.alpha_beta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """What one rank sent and received during one or more collectives (payload bytes, messages)."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    messages_sent: int = 0


def post_together(sends=(), recvs=()) -> list:
    """Post sends [(tensor, dst)] and receives [(tensor, src)] as one group with dist.batch_isend_irecv.

    On NCCL a rank's unbatched sends and receives run one after another and each waits for its peer, so a ring
    of isend-then-irecv deadlocks (notebook 04, the NCCL-rules mode); a batch is ncclGroupStart/End. Empty
    tensors are skipped on both sides (both sides know the sizes), as no bytes move.
    """
    ops = [dist.P2POp(dist.irecv, t, src) for t, src in recvs if t is not None and t.numel()]
    ops += [dist.P2POp(dist.isend, t, dst) for t, dst in sends if t is not None and t.numel()]
    return dist.batch_isend_irecv(ops) if ops else []


def exchange(send: torch.Tensor | None = None, dst: int | None = None, recv: torch.Tensor | None = None,
             src: int | None = None, traffic: Traffic | None = None) -> None:
    """Send `send` to rank `dst` and receive into `recv` from rank `src` at the same time, then wait for both.

    Both are posted together (post_together), so a ring where every rank sends right and receives left cannot
    deadlock, on gloo or NCCL.
    """
    works = post_together([(send, dst)] if send is not None else [], [(recv, src)] if recv is not None else [])
    if traffic is not None and send is not None and send.numel():
        traffic.bytes_sent += send.numel() * send.element_size()
        traffic.messages_sent += 1
    for w in works:
        w.wait()
    if traffic is not None and recv is not None:
        traffic.bytes_recv += recv.numel() * recv.element_size()


_OPS = {"sum": torch.Tensor.add_, "prod": torch.Tensor.mul_,
        "max": lambda a, b: a.copy_(torch.maximum(a, b)), "min": lambda a, b: a.copy_(torch.minimum(a, b))}


def reducer(op="sum"):
    """The in-place combine for a reduction: a string (sum, prod, max, min) or the matching dist.ReduceOp."""
    if not isinstance(op, str):
        names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.PRODUCT: "prod", dist.ReduceOp.MAX: "max",
                 dist.ReduceOp.MIN: "min"}
        op = next((name for k, name in names.items() if k == op), repr(op))
    if op not in _OPS:
        raise ValueError(f"unsupported reduction {op!r}: use one of {sorted(_OPS)}")
    return _OPS[op]


def flat_work(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view to work in: the tensor itself when contiguous, else a contiguous copy (copy back at the end).

    Why: a non-contiguous view handed to send/recv can move the wrong elements.
    """
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def finish(tensor: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Copy the result back when flat_work had to make a contiguous copy; return the caller's tensor."""
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor
