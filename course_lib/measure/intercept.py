"""Hooks on this rank's point-to-point calls (dist.send, recv, isend, irecv), for traffic.py and netem.py.

Why patching: the course's collectives (course_lib.collectives, notebook 06) and the parameter server call
`dist.isend`/`dist.irecv` through the module, so wrapping those four names for the duration of a `with` block makes
every message of both architectures visible (counted, delayed) without changing either. Only point-to-point calls
are seen: torch's own dist.all_reduce and DDP move their bytes inside gloo/NCCL and are not.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_NAMES = ("send", "recv", "isend", "irecv")


def nbytes(tensor) -> int:
    """Payload bytes of one message."""
    return tensor.numel() * tensor.element_size()


class _Work:
    """A receive request whose wait() runs the hook once the bytes are in (delegates everything else)."""

    def __init__(self, work, after):
        self._work, self._after, self._done = work, after, False

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        if not self._done:
            self._done = True
            self._after()
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextmanager
def hooked(before_send=None, after_recv=None):
    """Within the block, call before_send(tensor, dst) before each send and after_recv(tensor, src) once each
    receive has completed (for irecv: when its wait() returns). Nests: each block wraps what is current."""
    orig = {name: getattr(dist, name) for name in _NAMES}
    own = {name: getattr(c10d, name) for name in _NAMES}
    # batch_isend_irecv calls each P2POp's function with group_dst/group_src (the default group's rank = the rank)
    peer = lambda given, kwargs, key: given if given is not None else kwargs.get(key)  # noqa: E731

    def send(tensor, dst=None, *args, **kwargs):
        if before_send:
            before_send(tensor, peer(dst, kwargs, "group_dst"))
        return orig["send"](tensor, dst, *args, **kwargs)

    def isend(tensor, dst=None, *args, **kwargs):
        if before_send:
            before_send(tensor, peer(dst, kwargs, "group_dst"))
        return orig["isend"](tensor, dst, *args, **kwargs)

    def recv(tensor, src=None, *args, **kwargs):
        got = orig["recv"](tensor, src, *args, **kwargs)
        if after_recv:
            after_recv(tensor, got if peer(src, kwargs, "group_src") is None else peer(src, kwargs, "group_src"))
        return got

    def irecv(tensor, src=None, *args, **kwargs):
        work = orig["irecv"](tensor, src, *args, **kwargs)
        who = peer(src, kwargs, "group_src")
        return _Work(work, lambda: after_recv(tensor, who)) if after_recv else work

    patched = {"send": send, "recv": recv, "isend": isend, "irecv": irecv}
    # Both namespaces: dist.P2POp and batch_isend_irecv compare a P2POp's function with distributed_c10d's names.
    for name, fn in patched.items():
        setattr(dist, name, fn)
        setattr(c10d, name, fn)
    try:
        yield
    finally:
        for name in _NAMES:
            setattr(dist, name, orig[name])
            setattr(c10d, name, own[name])
