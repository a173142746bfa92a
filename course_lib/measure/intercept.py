"""Hooks on this rank's point-to-point calls (dist.send, recv, isend, irecv): wrappers, as the emulated link acts on
each wait().

Why patching: the course's collectives (course_lib.collectives, notebook 06) and the parameter server call
`dist.isend`/`dist.irecv` through the module, so wrapping those four names for the duration of a `with` block makes
every message of both architectures visible (counted by traffic.py, delayed by emulated_link.py) without changing
either. Why not recorder.py's dispatch mode: a dispatch mode sees only the calls of the thread that entered it, and
a whole training run under one would run Python for every tensor operation, where these four wrappers cost nothing
elsewhere; and the emulated link must act when a message's wait() returns, which the requests these wrappers hand out
do without patching torch's Work class (Watch, for a checker's short window, does patch it). Only point-to-point calls
are seen: torch's own dist.all_reduce and DDP move their bytes inside gloo/NCCL and are not.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_NAMES = ("send", "recv", "isend", "irecv")


class _Work:
    """A request whose wait() runs the hooks once the message is through (delegates everything else)."""

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


def _global_peer(given, kwargs, key):
    """The peer's global rank: `dst`/`src` are global; batch_isend_irecv passes group_dst/group_src (group ranks)."""
    if given is not None or kwargs.get(key) is None:
        return given
    group = kwargs.get("group")
    return kwargs[key] if group is None else dist.get_global_rank(group, kwargs[key])


def _then(*fns):
    """One callable running each non-None fn in order (the hooks of one completion)."""
    fns = [f for f in fns if f is not None]
    return lambda: [f() for f in fns]


@contextmanager
def hooked(before_send=None, after_recv=None, before_recv=None):
    """Within the block, call before_send(tensor, dst) before each send and after_recv(tensor, src) once each
    receive has completed (for irecv: when its wait() returns); before_recv(tensor, src) when a receive is posted
    (src None: from any rank). A before_* hook may return a callable: it runs when that message completes (a
    send: once its wait() returns; a receive: with the sender's rank, before after_recv). Peers are global ranks.
    Nests: each block wraps what is current."""
    orig = {name: getattr(dist, name) for name in _NAMES}
    own = {name: getattr(c10d, name) for name in _NAMES}

    inside = [0]   # torch 2.13's send and recv call isend and irecv: hook the outer call only

    def send(tensor, dst=None, *args, **kwargs):
        done = before_send(tensor, _global_peer(dst, kwargs, "group_dst")) if before_send else None
        inside[0] += 1
        try:
            out = orig["send"](tensor, dst, *args, **kwargs)
        finally:
            inside[0] -= 1
        if done:
            done()
        return out

    def isend(tensor, dst=None, *args, **kwargs):
        if inside[0]:
            return orig["isend"](tensor, dst, *args, **kwargs)
        done = before_send(tensor, _global_peer(dst, kwargs, "group_dst")) if before_send else None
        work = orig["isend"](tensor, dst, *args, **kwargs)
        return _Work(work, done) if done and work is not None else work

    def recv(tensor, src=None, *args, **kwargs):
        who = _global_peer(src, kwargs, "group_src")
        done = before_recv(tensor, who) if before_recv else None
        inside[0] += 1
        try:
            got = orig["recv"](tensor, src, *args, **kwargs)
        finally:
            inside[0] -= 1
        who = got if who is None else who
        if done:
            done(who)
        if after_recv:
            after_recv(tensor, who)
        return got

    def irecv(tensor, src=None, *args, **kwargs):
        if inside[0]:
            return orig["irecv"](tensor, src, *args, **kwargs)
        who = _global_peer(src, kwargs, "group_src")
        done = before_recv(tensor, who) if before_recv else None
        work = orig["irecv"](tensor, src, *args, **kwargs)
        if work is None or not (done or after_recv):
            return work
        # an any-source irecv (gloo only) learns its sender from the finished work
        sender = (lambda: who) if who is not None else work._source_rank
        return _Work(work, _then(done and (lambda: done(sender())),
                                 after_recv and (lambda: after_recv(tensor, sender()))))

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
