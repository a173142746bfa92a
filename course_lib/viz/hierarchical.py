"""The step trace of a hierarchical all-reduce, drawn with its nodes (course_lib.collectives.hierarchical_all_reduce).

Taught in notebooks/06_build_your_own_collectives.ipynb. The panels are course_lib.viz.steps' (ranks x shards after
each step); on top, a dashed line between nodes, and arrows bent by a fixed sideways amount whatever the distance,
so an arrow between rank i of two nodes stays in its shard's column instead of sweeping across its neighbours.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from .steps import plot_steps

SIDEWAYS = 0.15   # how far (in columns) an arrow bulges out of its column


def plot_hierarchical(steps: list[dict], chunks, per_node: int, cell=None, cols: int = 4, size: float = 2.6,
                      title: str | None = None) -> plt.Figure:
    """Every step of a merged hierarchical trace on one static figure, nodes of `per_node` ranks marked."""
    fig = plot_steps([{**s, "sends": []} for s in steps], chunks, cell=cell, cols=cols, title=title, size=size)
    p = len(steps[0]["buffers"])
    for ax, step in zip(fig.axes, steps):
        for boundary in range(per_node, p, per_node):
            ax.axhline(boundary - 0.05, color="0.3", ls="--", lw=0.8)
        for src, dst, chunk, _ in step["sends"]:
            rad = 2 * SIDEWAYS / abs(dst - src)          # arc3 bulges by rad x distance / 2
            ax.annotate("", xy=(chunk + 0.8, dst + 0.45), xytext=(chunk + 0.8, src + 0.45),
                        arrowprops=dict(arrowstyle="->", color="tab:red", lw=1.2,
                                        connectionstyle=f"arc3,rad={rad if dst > src else -rad}"))
    return fig
