"""Plots of the memory wall, compute wall, speed formula and link speeds, from numbers handed in.

Taught in notebooks/01_why_distributed.ipynb and notebooks/02_cluster_architecture.ipynb; the numbers come
from course_lib.hardware (data/ tables) and course_lib.bench.ceilings (this machine).
"""

from __future__ import annotations

import matplotlib.pyplot as plt

PART_COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52"}


def memory_bars(bars: dict, gpu_memory_GB: dict, title: str = "memory wall"):
    """Stacked bars in GB: bars = {label: {part: bytes}}; a vertical line per GPU memory size {label: GB}."""
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(bars) + 1.4), dpi=100)
    labels = list(bars)
    for i, lab in enumerate(labels):
        left = 0.0
        for part, nbytes in bars[lab].items():
            if part == "total":
                continue
            ax.barh(i, nbytes / 1e9, left=left, color=PART_COLORS.get(part, "gray"),
                    label=part if i == 0 or part not in ax.get_legend_handles_labels()[1] else None)
            left += nbytes / 1e9
        ax.text(left, i, f" {left:,.0f} GB", va="center", fontsize=8)
    for name, gb in gpu_memory_GB.items():
        ax.axvline(gb, color="black", ls="--", lw=1)
        ax.text(gb, len(labels) - 0.5, f"{name} ", fontsize=7, rotation=90, ha="right", va="top")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("GB (log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def gpu_hours_bars(rows: list[dict], title: str = "GPU-hours: published vs 6ND at one achieved FLOP/s"):
    """Pairs of bars per run: rows have name, published_gpu_hours, predicted_gpu_hours, error."""
    fig, ax = plt.subplots(figsize=(7, 3), dpi=100)
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["published_gpu_hours"] / 1e3 for r in rows], 0.4, label="published")
    ax.bar([i + 0.2 for i in x], [r["predicted_gpu_hours"] / 1e3 for r in rows], 0.4, label="6ND prediction")
    for i, r in zip(x, rows):
        ax.text(i + 0.2, r["predicted_gpu_hours"] / 1e3, f"{r['error']:+.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r["name"] for r in rows], fontsize=8)
    ax.set_ylabel("thousand GPU-hours")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def speed_plot(curve: list[dict], title: str = "speed = single-device speed x devices x speedup ratio"):
    """Speed (samples/s) against devices, with the ideal linear line, and the speedup ratio on a second panel."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3), dpi=100)
    ps = [c["devices"] for c in curve]
    a1.plot(ps, ps, "k--", label="ideal (ratio = 1)")
    a1.plot(ps, [c["speed"] / c["single_device_speed"] for c in curve], "o-", label="with ring all-reduce")
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("devices")
    a1.set_ylabel("speed (x one device)")
    a1.legend(fontsize=7)
    a2.plot(ps, [c["speedup_ratio"] for c in curve], "o-", color="#c44e52")
    a2.set_xscale("log", base=2)
    a2.set_ylim(0, 1.05)
    a2.set_xlabel("devices")
    a2.set_ylabel("multi-device speedup ratio")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def seconds_bars(items: dict, title: str, xlabel: str = "seconds (log scale)", highlight=()):
    """Horizontal bars on a log scale: items = {label: value}; labels in `highlight` drawn in red."""
    fig, ax = plt.subplots(figsize=(7, 0.28 * len(items) + 1.2), dpi=100)
    labels = list(items)
    ax.barh(range(len(labels)), [items[k] for k in labels],
            color=["#c44e52" if k in highlight else "#4c72b0" for k in labels])
    for i, k in enumerate(labels):
        ax.text(items[k], i, f" {items[k]:.3g}", va="center", fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
