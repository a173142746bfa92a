"""Step time and scaling efficiency against the number of workers: measured points, projected lines (notebook 10).

Draws what it is handed: measured {name: {n: seconds}} and course_lib.costs.projection.project() output. A
curve's colour says which architecture (ring, or the PS with k servers), its line style the PS mode: dashed for
push then pull, solid for pipelined and for the ring, cyan for rings over nodes of 8 GPUs.
"""

from __future__ import annotations

import re

import matplotlib.pyplot as plt

_RING = "#1f77b4"
_PS_BY_K = {1: "#d62728", 2: "#ff7f0e", 4: "#9467bd", 8: "#8c564b", 16: "#e377c2", 64: "#2ca02c"}


def _style(name: str) -> dict:
    """Colour by architecture and k (a curve and its measured points share it), dashes for push then pull."""
    if name.startswith("ring"):      # two-level rings in cyan: hierarchical dotted, 8 flat rings dash-dotted
        if "hierarchical" in name:
            return {"color": "#17becf", "ls": ":"}
        return {"color": "#17becf", "ls": "-."} if "flat rings" in name else {"color": _RING, "ls": "-"}
    k = re.search(r"k=(\d+)", name)
    color = _PS_BY_K.get(int(k.group(1)), "#7f7f7f") if k else "#7f7f7f"
    return {"color": color, "ls": "--" if "push then pull" in name else "-"}


def plot_step_times(measured: dict, projected: dict, title: str = "", ax=None):
    """Measured step seconds as dots, projected as lines, per architecture; x = workers, y = ms per step."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5.6, 3.6), dpi=100)
    for name, curve in projected.items():
        ax.plot(curve["n"], [t * 1e3 for t in curve["step_s"]], label=f"{name}, projected", **_style(name))
    for name, pts in measured.items():
        ns = sorted(pts)
        ax.plot(ns, [pts[n] * 1e3 for n in ns], "o", color=_style(name)["color"], label=f"{name}, measured")
    ticks = {n for pts in measured.values() for n in pts} | {n for c in projected.values() for n in c["n"]}
    ax.set_xticks(sorted(ticks))
    ax.set_xlabel("workers")
    ax.set_ylabel("ms per step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, handlelength=3.5)
    ax.figure.tight_layout()
    return ax


def plot_efficiency(projected: dict, title: str = "", ax=None):
    """Scaling efficiency (compute-only step / step time at n) on a log2 x axis out to the largest n given."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    for name, curve in projected.items():
        ax.plot(curve["n"], curve["efficiency"], marker="o", ms=3, label=name, **_style(name))
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency")
    ax.set_title(title, fontsize=10)
    # handles long enough to tell dashed (push then pull) from solid (pipelined)
    ax.legend(fontsize=7, handlelength=3.5, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.figure.tight_layout()
    return ax
