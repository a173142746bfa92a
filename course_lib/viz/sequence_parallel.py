"""What each rank keeps for backward under tensor and sequence parallelism, by activation (notebook 13, section 7).

Draws the bytes a run measured with saved-tensor hooks, one stacked bar per layout, next to the single process's
bar cut into p equal parts: the share each rank would keep if every activation were split (Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.2.2). viz only draws what it is
handed.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

PALETTE = plt.get_cmap("tab10").colors


def plot_kept_for_backward(kept: dict, p: int, title: str = ""):
    """kept = {layout: {activation: bytes per rank}}, its first layout the single process; one horizontal stacked
    bar per layout, each activation in the same colour throughout, the total at the bar's end, and a dashed line
    at the single process's total / p."""
    layouts = list(kept)
    parts = list(dict.fromkeys(name for row in kept.values() for name in row))
    colors = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(parts)}
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(layouts) + 1.6), dpi=100)
    for y, layout in enumerate(layouts):
        left = 0
        for name in parts:
            b = kept[layout].get(name, 0)
            if b:
                ax.barh(y, b, left=left, color=colors[name], edgecolor="white", height=0.6)
                left += b
        ax.text(left, y, f" {left:,} B", va="center", fontsize=8)
    share = sum(kept[layouts[0]].values()) / p
    ax.axvline(share, color="gray", ls="--", lw=1)
    ax.set_ylim(len(layouts) - 0.5, -1.0)                 # the first layout on top, a strip above it for the label
    ax.text(share, -0.75, f" one process / {p}", ha="left", va="center", fontsize=7, color="gray")
    ax.set_yticks(range(len(layouts)), layouts, fontsize=8)
    ax.set_xlabel("bytes saved for backward, per rank (float64)")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in parts], labels=parts, fontsize=7,
              loc="lower right")
    ax.margins(x=0.12)
    fig.tight_layout()
    return fig
