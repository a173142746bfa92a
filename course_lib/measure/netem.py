"""Network emulation for point-to-point messages: a link of latency alpha and one-direction bandwidth B (notebook 10).

Each rank has one full-duplex NIC: an outgoing side that sends one message at a time (a message of b bytes holds
it for alpha + b/B seconds) and an incoming side that cannot deliver faster than B. Emulated by sleeping: before a
send until the outgoing side is free and the message has left; after a receive until the incoming side could have
taken it (max(arrival, previous delivery + b/B)). So n workers pushing to one server take ~n*b/B at the server,
and a ring step between neighbours takes alpha + b/B: the alpha-beta model of costs/alpha_beta.py, made real on a
laptop. Real localhost transfer time comes on top (small next to slow links; see the notebook's error column).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

from ..costs import hardware
from .intercept import hooked, nbytes


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


def _sleep_until(t: float) -> None:
    # Sleep, never spin: ranks share few cores, and a spinning rank steals the CPU its peers need.
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


@contextmanager
def emulate(lnk: Link | str | None):
    """Inside the block, every point-to-point message of this rank goes over `lnk` (None: no emulation)."""
    if lnk is None:
        yield None
        return
    lnk = link(lnk) if isinstance(lnk, str) else lnk
    state = {"tx_free": 0.0, "rx_free": 0.0}

    def before_send(tensor, dst):
        start = max(time.perf_counter(), state["tx_free"])
        state["tx_free"] = start + lnk.alpha + nbytes(tensor) * lnk.beta
        _sleep_until(state["tx_free"])

    def after_recv(tensor, src):
        done = max(time.perf_counter(), state["rx_free"] + nbytes(tensor) * lnk.beta)
        state["rx_free"] = done
        _sleep_until(done)

    with hooked(before_send, after_recv):
        yield lnk
