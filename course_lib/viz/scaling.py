"""Step time and scaling efficiency against the number of workers: measured points, projected lines (notebook 10).

Draws what it is handed: measured {name: {n: seconds}} and course_lib.training.projection.project() output.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

_COLORS = {"ring": "#1f77b4", "ps k=1": "#d62728", "ps k=2": "#ff7f0e", "ps k=4": "#9467bd", "ps k=8": "#8c564b",
           "ps k=16": "#e377c2", "ps k=64": "#2ca02c"}


def plot_step_times(measured: dict, projected: dict, title: str = "", ax=None):
    """Measured step seconds as dots, projected as lines, per architecture; x = workers, y = ms per step."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.4), dpi=100)
    for name, curve in projected.items():
        ax.plot(curve["n"], [t * 1e3 for t in curve["step_s"]], "-", color=_COLORS.get(name), label=f"{name} projected")
    for name, pts in measured.items():
        ns = sorted(pts)
        ax.plot(ns, [pts[n] * 1e3 for n in ns], "o", color=_COLORS.get(name), label=f"{name} measured")
    ticks = {n for pts in measured.values() for n in pts} | {n for c in projected.values() for n in c["n"]}
    ax.set_xticks(sorted(ticks))
    ax.set_xlabel("workers")
    ax.set_ylabel("ms per step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.figure.tight_layout()
    return ax


def plot_efficiency(projected: dict, title: str = "", ax=None):
    """Scaling efficiency (step time at 1 worker / step time at n) on a log2 x axis out to the largest n given."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.4), dpi=100)
    for name, curve in projected.items():
        ax.plot(curve["n"], curve["efficiency"], "-o", ms=3, color=_COLORS.get(name), label=name)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.figure.tight_layout()
    return ax
