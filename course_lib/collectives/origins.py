"""Where every output element of a collective came from, recorded by running it once more on tags (notebook 05).

The trick: give element i of rank r the int64 tag 2^(r*L + i), L = the longest input over ranks, then run the
very same collective on the tags. A copy moves a tag unchanged (one bit set: its source); a SUM adds distinct powers
of two, so the result's bits are exactly the (rank, element) pairs that went into it; an element no rank wrote keeps
the zero of its buffer. course_lib.viz.tensors colours the figure from these bits, never from equal values.
MAX and MIN choose one input instead of combining them: `winners` records which ranks held the winning value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MAX_BITS = 63  # bits of an int64 that stay positive


def _width(x: torch.Tensor | None, dev, group=None) -> int:
    """L: the longest tagged input over all ranks (every rank must agree on it to decode the bits the same way)."""
    n = torch.tensor([0 if x is None else x.numel()], dtype=torch.int64, device=dev)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    return int(n.item())


def _tags(x: torch.Tensor, width: int, group=None) -> torch.Tensor:
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    if p * width > MAX_BITS:
        raise ValueError(f"provenance tags need world_size x elements <= {MAX_BITS} bits of an int64; got {p} ranks "
                         f"x {width} elements: draw a smaller tensor")
    bits = rank * width + torch.arange(x.numel(), device=x.device)
    return (torch.ones_like(bits) << bits).reshape(x.shape)


def _zeros_like(b):
    """An output buffer of the tag run: same shape, int64, all zero (= written by no rank); non-tensors pass as is."""
    if isinstance(b, (list, tuple)):
        return type(b)(_zeros_like(t) for t in b)
    if isinstance(b, torch.Tensor):
        return torch.zeros(b.shape, dtype=torch.int64, device=b.device)
    return b  # None, a process group, a number: handed to op unchanged


def _to_cpu(out):
    if isinstance(out, torch.Tensor):
        return out.detach().to("cpu").clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_to_cpu(t) for t in out)
    if isinstance(out, dict):
        return {k: _to_cpu(v) for k, v in out.items()}
    return out


def origins(op, x: torch.Tensor | None, *args):
    """Run ``op(tags, *args)`` where tags replace x and every tensor in args an int64 zero copy; return its result.

    ``op`` is the collective exactly as the lesson calls it, written as a function of its input (and of its output
    buffers and anything else it needs, like a group) that returns what the figure draws; an in-place op may return
    None (the tags are returned then). Every rank must call this, as every rank calls the collective. x may be None
    on ranks that hold no input (scatter's non-roots). Element i of rank r in the result has bit r*L + i set iff that
    element went into it.
    """
    import course_lib

    dev = x.device if x is not None else course_lib.device()
    width = _width(x, dev)
    tags = None if x is None else _tags(x, width)
    out = op(tags, *(_zeros_like(a) for a in args))
    return _to_cpu(tags if out is None else out)


def winners(x: torch.Tensor, result: torch.Tensor, group=None) -> torch.Tensor:
    """For MAX or MIN: the tags of the (rank, element) pairs whose input equals the reduced result.

    The result of a MAX is one rank's value, not a combination, so its source is the rank (or ranks, on a tie) that
    held it; each rank marks where its own input equals the result and one SUM collects the marks.
    """
    width = _width(x, x.device, group)
    mine = torch.where(x == result, _tags(x, width, group), torch.zeros((), dtype=torch.int64, device=x.device))
    dist.all_reduce(mine, op=dist.ReduceOp.SUM, group=group)
    return _to_cpu(mine)


def sources(tag: int, width: int) -> list[tuple[int, int]]:
    """The (rank, element) pairs whose bits are set in one tag (decoding what `origins` recorded)."""
    tag = int(tag)
    return [(b // width, b % width) for b in range(MAX_BITS) if tag >> b & 1]
