"""What each rank holds and keeps for backward under tensor and sequence parallelism (notebook 13, section 7).

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


def plot_block_flow(flows: dict, title: str = ""):
    """One row per layout of a block: boxes are what a rank holds (label, shape), circles the operators between
    them (name, forward collective, backward collective), forward above a circle and backward below (Megatron's
    figure 3a; Korthikanti et al. 2022, figure 5)."""
    fig, ax = plt.subplots(figsize=(11, 1.55 * len(flows) + 0.4), dpi=100)
    for row, (layout, stages) in enumerate(flows.items()):
        y = -row * 1.6
        ax.text(-0.2, y + 0.55, layout, fontsize=9, fontweight="bold", va="bottom")
        for i, stage in enumerate(stages):
            x = i * 1.45
            if len(stage) == 2:                           # what the rank holds here
                label, shape = stage
                ax.add_patch(plt.Rectangle((x - 0.6, y - 0.3), 1.2, 0.6, facecolor="#eef3fb", edgecolor="#1f77b4"))
                ax.text(x, y + 0.08, label, ha="center", va="center", fontsize=7.5)
                ax.text(x, y - 0.16, shape, ha="center", va="center", fontsize=7.5, color="#1f77b4")
            else:                                         # an operator between two tensors
                name, fwd, bwd = stage
                ax.add_patch(plt.Circle((x, y), 0.22, facecolor="#fde8d8" if fwd or bwd else "white",
                                        edgecolor="#d62728" if fwd or bwd else "grey"))
                ax.text(x, y, name, ha="center", va="center", fontsize=8)
                if fwd or bwd:
                    ax.text(x, y + 0.34, f"fwd: {fwd or 'nothing'}", ha="center", fontsize=7, color="#d62728")
                    ax.text(x, y - 0.46, f"bwd: {bwd or 'nothing'}", ha="center", fontsize=7, color="#7f7f7f")
            if i:
                ax.annotate("", (x - (0.6 if len(stage) == 2 else 0.22), y),
                            (x - 1.45 + (0.22 if len(stages[i - 1]) == 3 else 0.6), y),
                            arrowprops=dict(arrowstyle="->", color="grey", lw=0.8))
    n = max(len(s) for s in flows.values())
    ax.set_xlim(-0.8, (n - 1) * 1.45 + 0.8)
    ax.set_ylim(-(len(flows) - 1) * 1.6 - 0.75, 0.95)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
