"""Count the torch.distributed collectives a rank calls from any thread: wrappers, as a dispatch mode is thread-local.

CommLog (comm_log.py) sees collectives through a dispatch mode, which is thread-local: a DDP communication hook's
later all-reduces run in callbacks on gloo's threads, outside it (notebook 11b: DDP's PowerSGD hook). Wrapping the
functions of the torch.distributed module instead sees every call that looks them up there, whatever the thread, as
the hooks in torch.distributed.algorithms.ddp_comm_hooks do (`dist.all_reduce(...)`); each wrapped call runs inside
recorder.py's dispatch mode, entered on the thread that makes it, so its figures are the Recorder's events. Only
calls made inside the block count.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from .c10d_ops import ALL_COLLECTIVES, COLLECTIVES
from .recorder import Recorder

# every tensor collective's torch.distributed name (object collectives pickle, their tensors are not the caller's)
NAMES = tuple(n for c in ALL_COLLECTIVES for n in COLLECTIVES[c][0] if "object" not in n and not n.startswith("_"))


@dataclass
class Call:
    """One collective call: its torch.distributed name and the elements and bytes of its largest tensor argument."""

    op: str
    numel: int
    nbytes: int


@contextmanager
def counted(names=NAMES):
    """`with counted() as calls:` appends a Call to `calls` for each call of a torch.distributed collective in
    `names` that completed (one that raised, or returned without reaching c10d, moved nothing)."""
    calls: list[Call] = []
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def wrap(name, fn):
        def call(*args, **kwargs):
            with Recorder() as seen:       # on this thread, whichever it is: gloo's, for a hook's callback
                out = fn(*args, **kwargs)
            calls.extend(Call(name, e.numel, e.nbytes) for e in seen.events)
            return out
        return call

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
