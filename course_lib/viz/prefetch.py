"""ZeRO-3's forward without and with prefetch, drawn from the events the ranks recorded (notebook 12, section 10).

Draws what it is handed (course_lib.training.prefetch.forward_times events: (lane, name, start_s, end_s) on the
emulated link's clock); launches nothing. The lanes of timeline.plot_lanes, with every block outlined and named
(L2: layer 2's compute, AG2: its all-gather), so that a gather running under the previous layer's compute shows.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from .timeline import COLORS

_ROW = {"compute": 0, "comm": 1, "wait": 2}
_LEGEND = {"compute": "compute (L i: layer i)", "comm": "all-gather on the link (AG i)",
           "wait": "waiting for a weight"}


def _short(lane: str, name: str) -> str:
    """'layer 2' -> 'L2', 'all-gather 2' -> 'AG2'; waits are not named."""
    number = name.split()[-1]
    return {"compute": f"L{number}", "comm": f"AG{number}"}.get(lane, "")


def plot_prefetch(rows: dict, title: str = "", ax=None):
    """One band per entry of `rows` ({label: events}), three lanes in it; x = milliseconds on the emulated clock."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.0), dpi=100)
    for r, events in enumerate(rows.values()):
        for lane, name, s, e in events:
            if e <= s:
                continue                       # a wait of zero: the weight was already there
            y = r + 0.1 + 0.27 * _ROW[lane]
            ax.broken_barh([(s * 1e3, (e - s) * 1e3)], (y, 0.24), facecolor=COLORS[lane], edgecolor="white", lw=1)
            label = _short(lane, name)
            if label:
                ax.text((s + e) / 2 * 1e3, y + 0.125, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks([r + 0.5 for r in range(len(rows))])
    ax.set_yticklabels(list(rows))
    ax.set_ylim(len(rows), 0)
    ax.set_xlabel("time on the emulated link's clock (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[lane]) for lane in _LEGEND]
    ax.legend(handles, list(_LEGEND.values()), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.figure.tight_layout()
    return ax
