"""Bytes each rank sends and receives per training step, and the formulas they must match (notebooks 08, 10).

Formulas from course_lib.costs.alpha_beta (BytePS, Jiang et al. OSDI'20; Patarasuk & Yuan 2009): a single parameter
server receives n*M and sends n*M bytes per step (k servers: n*M/k each); ring all-reduce sends 2(n-1)/n*M per rank.
The bytes are counted through intercept.py's hooks on dist.send/recv/isend/irecv (batch_isend_irecv included), the
messages the emulated link delays: a send when it is posted, a receive when it completes (one whose wait() falls in the
next step counts there). A message posted through the ProcessGroup object or torch's functional p2p is not seen here;
the checkers' Watch (recorder.py's events) sees those too.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from ..costs import alpha_beta
from .c10d_ops import nbytes
from .intercept import hooked


@dataclass
class Meter:
    """Running totals of this rank's point-to-point payload bytes, and one (sent, received) pair per step."""

    sent: int = 0
    recv: int = 0
    steps: list = field(default_factory=list)
    _mark: tuple = (0, 0)

    def step(self) -> tuple[int, int]:
        """Close the current step: record and return the bytes (sent, received) since the previous call."""
        delta = (self.sent - self._mark[0], self.recv - self._mark[1])
        self.steps.append(delta)
        self._mark = (self.sent, self.recv)
        return delta

    def skip(self) -> None:
        """Leave what was counted since the last step out of every step (e.g. the first pull, before step 0)."""
        self._mark = (self.sent, self.recv)


@contextmanager
def metered(meter: Meter):
    """Count every dist.send/isend/recv/irecv payload of this rank into `meter` inside the block."""
    def on_send(tensor, dst):
        meter.sent += nbytes(tensor)

    def on_recv(tensor, src):
        meter.recv += nbytes(tensor)

    with hooked(on_send, on_recv):
        yield meter


def expected(arch: str, n_workers: int, model_bytes: int, k_servers: int = 1) -> dict:
    """Bytes per step the formula gives: arch 'ps' -> each server's in/out and each worker's out/in;
    'ring' -> each rank's sent and received (2(n-1)/n M, exact when n divides the element count)."""
    if arch == "ps":
        c = alpha_beta.ps_vs_allreduce(n_workers, model_bytes, 1.0, k_servers)
        return {"server_recv": c["ps_server_bytes_in"], "server_sent": c["ps_server_bytes_out"],
                "worker_sent": model_bytes, "worker_recv": model_bytes}
    if arch == "ring":
        per_rank = alpha_beta.allreduce_traffic("ring", n_workers, model_bytes)["busiest"]
        return {"rank_sent": per_rank, "rank_recv": per_rank}
    raise ValueError(f"unknown arch {arch!r}: 'ps' or 'ring'")
