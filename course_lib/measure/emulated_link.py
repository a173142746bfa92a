"""An emulated network on a virtual clock: every point-to-point message crosses a link of latency alpha and
one-direction bandwidth B (notebooks 08-11b).

Each rank keeps its own clock, which moves only by emulated compute (`compute(seconds)`) and by messages, so
the times are those of the schedule on the link, the same on every machine. A message behaves as gloo's TCP
send does, a rendezvous ("sends cannot execute until the remote side is ready to receive", gloo/transport/tcp/
pair.cc): it starts once both sides have posted and the sender's one outgoing side is free, holds that side for
alpha + b/B, and is delivered no sooner than the receiver's incoming side can take b more bytes. This is the
alpha-beta model of costs/alpha_beta.py on one full-duplex NIC per rank. The ranks agree on each message's start
through the group's store, where each side writes when it posted. The payloads themselves move for real.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..costs import hardware
from .c10d_ops import nbytes
from .intercept import hooked


@dataclass(frozen=True)
class Link:
    """alpha: seconds per message; bandwidth: bytes per second in ONE direction (full duplex)."""

    name: str
    alpha: float
    bandwidth: float

    @property
    def beta(self) -> float:
        """Seconds per byte (1 / bandwidth), the beta of the alpha-beta model."""
        return 1.0 / self.bandwidth


def links() -> dict[str, Link]:
    """Named links: two slow Ethernets (whose delays are visible on a laptop) plus every row of data/links.csv
    (GBps_one_direction and typical_latency_us from that table, whose sources and caveats are in its rows)."""
    out = {
        # 1 Gb/s line rate = 125 MB/s each way; 50 us is an assumed TCP-over-Ethernet message latency (not sourced).
        "1 GbE": Link("1 GbE", 50e-6, 125e6),
        "100 MbE": Link("100 MbE", 100e-6, 12.5e6),
    }
    for row in hardware.links():
        out[row["name"]] = Link(row["name"], float(row["typical_latency_us"]) * 1e-6,
                                float(row["GBps_one_direction"]) * 1e9)
    return out


def link(name: str) -> Link:
    """One link by name (see links()); a short alias works: '10 GbE', '100 Gb InfiniBand', 'NVLink'."""
    aliases = {"10 GbE": Link("10 GbE", 10e-6, 1.25e9), "100 Gb InfiniBand": links()["InfiniBand EDR"],
               "NVLink": links()["NVLink 4 (H100)"]}
    table = {**links(), **aliases}
    if name not in table:
        raise KeyError(f"unknown link {name!r}; one of {sorted(table)}")
    return table[name]


# How long a rank waits in the store for a peer's record of a message before it names the peer and gives up.
WAIT_S = 60.0
_CLOCK: VirtualClock | None = None
_LAST_BUSY: dict[str, list] = {"out": [], "in": []}
_BLOCKS = [0]   # emulate() blocks entered by this rank: every rank enters the same ones, so keys never mix


class VirtualClock:
    """One rank's clock and NIC over an emulated link; messages are matched with the peers' through the store.

    A message is rank s's i-th send (its j-th to rank d) and rank d's q-th receive. Each side writes when it
    posted; from those records any rank computes the same two chains: when s's i-th message starts (both sides
    posted, s's outgoing side free after message i - 1) and when d's q-th receive has its bytes (d's incoming side
    free after receive q - 1). Both sides finish the message at that arrival."""

    def __init__(self, lnk: Link, store, prefix: str):
        self.link, self.store, self.prefix = lnk, store, prefix
        self.rank = dist.get_rank()
        self.now = 0.0          # seconds since every rank entered the block (each rank's own view)
        self._count = {"sent": 0, "recv": 0}
        self._pair: dict[tuple[str, int], int] = {}
        self._memo: dict[tuple[str, int, int], float] = {}
        self.busy: dict[str, list] = {"out": [], "in": []}    # (start, end, peer) of each message on each side

    def _key(self, *parts) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _get(self, key: str, who: str) -> str:
        try:
            self.store.wait([key], timedelta(seconds=WAIT_S))
        except Exception as e:    # the store's timeout error names neither rank nor message
            raise RuntimeError(f"rank {self.rank}: the emulated link waited {WAIT_S:.0f} s for {who}; "
                               "every send needs a matching receive, and a rank's messages leave (and arrive) "
                               "in the order it posted them") from e
        return self.store.get(key).decode()

    def _next(self, what: str, peer: int) -> tuple[int, int]:
        """This rank's next index overall and on the pair with `peer`, for `what` in ('sent', 'recv')."""
        n, j = self._count[what], self._pair.get((what, peer), 0)
        self._count[what], self._pair[(what, peer)] = n + 1, j + 1
        return n, j

    def _wire(self, nb: int) -> float:
        return self.link.alpha + nb / self.link.bandwidth

    def _chain(self, kind: str, who: int, idx: int, step) -> float:
        """Value idx of a chain where each value needs the one before (step(who, n, previous)), memoised in the
        store so that every rank computes each one at most once."""
        k = idx
        while k >= 0 and (kind, who, k) not in self._memo:
            key = self._key(kind, who, k)
            if self.store.check([key]):
                self._memo[(kind, who, k)] = float(self.store.get(key).decode())
                break
            k -= 1
        for n in range(k + 1, idx + 1):
            value = step(who, n, self._memo.get((kind, who, n - 1)))
            self._memo[(kind, who, n)] = value
            self.store.set(self._key(kind, who, n), repr(value))
        return self._memo[(kind, who, idx)]

    def _send(self, src: int, i: int) -> tuple[float, int, int, int]:
        t_post, nb, dst, j = self._get(self._key("m", src, i), f"rank {src}'s send").split()
        return float(t_post), int(nb), int(dst), int(j)

    def _start_step(self, src: int, i: int, prev: float | None) -> float:
        t_post, nb, dst, j = self._send(src, i)
        ready = self._get(self._key("r", src, dst, j), f"rank {dst} to post its receive from rank {src}")
        free = 0.0 if i == 0 else prev + self._wire(self._send(src, i - 1)[1])
        return max(t_post, float(ready.split()[0]), free)

    def _arrive_step(self, dst: int, q: int, prev: float | None) -> float:
        src, j = map(int, self._get(self._key("in", dst, q), f"rank {dst}'s receive").split())
        i = int(self._get(self._key("p", src, dst, j), f"rank {src}'s send to rank {dst}"))
        nb = self._send(src, i)[1]
        start = self._chain("s", src, i, self._start_step)
        return max(start + self._wire(nb), 0.0 if q == 0 else prev + nb / self.link.bandwidth)

    def on_send(self, tensor, dst):
        i, j = self._next("sent", dst)
        self.store.set(self._key("p", self.rank, dst, j), str(i))
        self.store.set(self._key("m", self.rank, i), f"{self.now!r} {nbytes(tensor)} {dst} {j}")

        def done():
            q = int(self._get(self._key("r", self.rank, dst, j), f"rank {dst} to post its receive").split()[1])
            self.now = max(self.now, self._chain("a", dst, q, self._arrive_step))
            start = self._chain("s", self.rank, i, self._start_step)
            self.busy["out"].append((start, start + self._wire(nbytes(tensor)), dst))
        return done

    def on_recv(self, tensor, src):
        posted, slot = self.now, [None]
        if src is not None:     # a known sender can see at once that this side is ready
            slot[0] = self._ready(src, posted)

        def done(sender):
            q = slot[0] if slot[0] is not None else self._ready(sender, posted)   # any-source: known only now
            arrived = self._chain("a", self.rank, q, self._arrive_step)
            self.now = max(self.now, arrived)
            self.busy["in"].append((arrived - nbytes(tensor) / self.link.bandwidth, arrived, sender))
        return done

    def _ready(self, src: int, posted: float) -> int:
        """Record that this rank's next receive, from src, was ready at `posted`; return its index q."""
        q, j = self._next("recv", src)
        self.store.set(self._key("in", self.rank, q), f"{src} {j}")
        self.store.set(self._key("r", src, self.rank, j), f"{posted!r} {q}")
        return q


@contextmanager
def emulate(lnk: Link | str | None):
    """Inside the block, every point-to-point message of this rank crosses `lnk` on the virtual clock (None: no
    emulation; now() and compute() then use real time)."""
    global _CLOCK
    if lnk is None:
        yield None
        return
    if _CLOCK is not None:
        raise RuntimeError("emulate() blocks do not nest: one link per rank at a time")
    lnk = link(lnk) if isinstance(lnk, str) else lnk
    _BLOCKS[0] += 1
    clock = VirtualClock(lnk, c10d._get_default_store(), f"emulated_link/{_BLOCKS[0]}")
    _CLOCK = clock
    try:
        with hooked(clock.on_send, before_recv=clock.on_recv):
            yield lnk
    finally:
        _CLOCK = None
        _LAST_BUSY.update(clock.busy)


def link_busy() -> dict[str, list]:
    """When this rank's NIC was busy in the last emulate() block: {"out": [(start, end, peer)], "in": [...]}."""
    return {side: list(v) for side, v in _LAST_BUSY.items()}


def virtual() -> bool:
    """True inside emulate(link): now() is this rank's virtual clock."""
    return _CLOCK is not None


def now() -> float:
    """This rank's time in seconds: the virtual clock inside emulate(link), else time.perf_counter()."""
    return _CLOCK.now if _CLOCK is not None else time.perf_counter()


def compute(seconds: float) -> None:
    """Charge `seconds` of emulated compute: on the virtual clock inside emulate(link), else by sleeping (a
    sleeping rank holds no core, so ranks sharing a laptop's cores still each get the whole cost)."""
    if _CLOCK is not None:
        _CLOCK.now += seconds
    elif seconds > 0:
        time.sleep(seconds)
