"""Per-rank lanes of compute, communication and waiting, drawn from Timeline events (notebooks 08-10).

Draws what it is handed (course_lib.measure.timeline events: (lane, name, start_s, end_s) per rank); launches
nothing.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

COLORS = {"compute": "#4c9a2a", "comm": "#1f77b4", "wait": "#d62728"}
_ROW = {"compute": 0, "comm": 1, "wait": 2}


def plot_lanes(per_rank: list, labels: list | None = None, title: str = "", ax=None, until: float | None = None,
               marks: dict | None = None):
    """One band per rank, three thin lanes in it (compute, comm, wait); x = milliseconds since the common barrier.
    Nested regions in a lane overdraw their parent (same colour). `until`: cut the x axis (seconds). `marks`:
    {label: seconds}, each drawn as a dashed vertical line across every rank, labelled at the top."""
    n = len(per_rank)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.55 * n + 1.0), dpi=100)
    for r, events in enumerate(per_rank):
        for lane, _, s, e in events:
            y = r + 0.1 + 0.27 * _ROW[lane]
            ax.broken_barh([(s * 1e3, max(e - s, 1e-6) * 1e3)], (y, 0.24), color=COLORS[lane], lw=0)
    ax.set_yticks([r + 0.5 for r in range(n)])
    ax.set_yticklabels(labels or [f"rank {r}" for r in range(n)])
    ax.set_ylim(n, 0)
    ax.set_xlabel("time since the ranks started together (ms)")
    if until is not None:
        ax.set_xlim(0, until * 1e3)
    for label, t in (marks or {}).items():
        ax.axvline(t * 1e3, color="black", ls="--", lw=1)
        ax.text(t * 1e3, 0.99, f" {label}", transform=ax.get_xaxis_transform(), fontsize=8, va="top")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.figure.tight_layout()
    return ax


def plot_link(busy: dict, title: str = "", ax=None):
    """One NIC's two directions as two lanes, each message a bar while it holds that side
    (emulated_link.link_busy())."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 1.3), dpi=100)
    for row, side in enumerate(("out", "in")):
        ax.broken_barh([(s * 1e3, (e - s) * 1e3) for s, e, _ in busy[side]], (row + 0.15, 0.7),
                       color=("#1f77b4", "#ff7f0e")[row], edgecolor="white", lw=0.5)   # white edges part messages
    ax.set_yticks([0.5, 1.5])
    ax.set_yticklabels(["sending", "receiving"])
    ax.set_ylim(2, 0)
    ax.set_title(title, fontsize=9)
    return ax
