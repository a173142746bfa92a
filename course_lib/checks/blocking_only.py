"""Exercises that ask for the blocking dist.send and dist.recv (notebook 04's ring): every other way to post a message
is switched off, the ProcessGroup object's own send/recv included, which no Python name stub can reach."""

from __future__ import annotations


def _blocking_only_mode(exercise: str):
    """A dispatch mode refusing any message not posted from inside the blocking dist.send / dist.recv."""
    from ..measure.c10d_ops import RECVS, SENDS, op_key
    from .switch_off import SwitchedOff, _attempts, _classes, _dispatch_mode_base

    if "blocking" not in _classes:
        class BlockingOnly(_dispatch_mode_base()):
            def __init__(self, exercise):
                super().__init__()
                self.exercise, self.inside = exercise, 0     # inside: depth of dist.send / dist.recv calls

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                key = op_key(func)
                if (key in SENDS or key in RECVS) and not self.inside:
                    message = (f"{self.exercise} asks for the blocking dist.send and dist.recv only; a message posted "
                               f"another way (here torch.ops.{key}: isend/irecv, batch_isend_irecv or a "
                               "ProcessGroup's own send/recv) is switched off here.")
                    _attempts.append(message)
                    raise SwitchedOff(message)
                return func(*args, **(kwargs or {}))

        _classes["blocking"] = BlockingOnly
    return _classes["blocking"](exercise)


def blocking_call(exercise: str, fn, t):
    """``fn(t)`` where every message must come from dist.send / dist.recv: the ProcessGroup object's own send and
    recv post without waiting, like isend/irecv, and reach the same c10d operators, so only the caller tells them
    apart."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    mode = _blocking_only_mode(exercise)
    saved = {(m, n): getattr(m, n) for m in (dist, c10d) for n in ("send", "recv")}

    def counted(real):
        def call(*args, **kwargs):
            __tracebackhide__ = True  # noqa: F841  a deadlock report names the learner's line, not this one
            mode.inside += 1
            try:
                return real(*args, **kwargs)
            finally:
                mode.inside -= 1
        return call

    for (m, n), real in saved.items():
        setattr(m, n, counted(real))
    try:
        with mode:
            return fn(t)
    finally:
        for (m, n), real in saved.items():
            setattr(m, n, real)
