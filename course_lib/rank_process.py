"""A rank process as the kernel sees it: the environment it starts with, its pipes, its output and its result.

Used by launch.py (one-shot ranks) and interactive.py (persistent ranks); the rank's own side is _rank_main.py.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct

_LEN = struct.Struct("!Q")  # the result pipe: an optional b"S" (function started), then length + cloudpickle


def _loopback_ifname() -> str | None:
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


def rank_env(the_plan, rank: int, threads: int, check_collectives: bool, port: int | None = None) -> dict:
    """The environment of one rank: the kernel's own, plus the variables torchrun would set."""
    env = dict(os.environ)
    n = the_plan.world_size
    if port is not None:
        env["MASTER_PORT"] = str(port)
    env.update(
        MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(n),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0", OMP_NUM_THREADS=str(threads),
        # With this set, dist.init_process_group("env://") on every rank connects to our store as a client,
        # exactly as under torchrun, so a learner may also initialise the group in the cell (init=False).
        TORCHELASTIC_USE_AGENT_STORE="True", COURSE_DEVICE=the_plan.devices[rank],
    )
    if check_collectives:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    lo = _loopback_ifname()
    if lo and the_plan.backend == "gloo":
        env.setdefault("GLOO_SOCKET_IFNAME", lo)  # one machine: no need to resolve the hostname
    return env


class RankProcess:
    """The kernel's view of one rank process: its pipes, what it printed, how it ended."""

    def __init__(self, rank: int, pid: int, out_r: int, err_r: int, res_r: int):
        self.rank, self.pid = rank, pid
        self.fds = {"out": out_r, "err": err_r, "res": res_r}
        self.open = set(self.fds)
        self.text = {"out": [], "err": []}
        self.partial = {"out": b"", "err": b""}
        self.res = b""
        self.exit: int | None = None
        self.exit_seen = 0.0
        self.stopped_by_us = False

    def done(self, now: float) -> bool:
        return self.exit is not None and (not self.open or now - self.exit_seen > 1.0)

    @property
    def started(self) -> bool:
        """The rank got past process-group setup and began the learner's function."""
        return self.res[:1] == b"S"

    def result(self) -> dict | None:
        buf = self.res[1:] if self.started else self.res
        if len(buf) < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(buf)
        if len(buf) < _LEN.size + n:
            return None
        return pickle.loads(buf[_LEN.size : _LEN.size + n])

    def tail(self, kind: str, lines: int = 12) -> str:
        text = "".join(self.text[kind]).rstrip("\n")
        return "\n".join(text.split("\n")[-lines:]) if text else ""
