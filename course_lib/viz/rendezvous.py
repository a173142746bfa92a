"""A multi-node launch as its own output tells it: the torchrun "nodes", their workers, the two stores, and which
worker pairs talk across the network between nodes.

Taught in notebooks/17_multi_node_lab.ipynb. The function draws what it is handed: one record per worker line the
run printed (which torchrun printed it, RANK, LOCAL_RANK, GROUP_RANK, backend, MASTER_ADDR:MASTER_PORT), the
rendezvous endpoint from the launch line, and which torchrun hosts the rendezvous store.
"""

from __future__ import annotations

from itertools import combinations

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import FancyBboxPatch

CROSS, INSIDE, STORE, RDZV = "#d62728", "#2ca02c", "#1f77b4", "#7f7f7f"
W, GAP = 4.0, 2.0                        # node box width, space between boxes (the network)


def _box(ax, x, y, w, h, text, face, edge="black", size=8, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", facecolor=face, edgecolor=edge))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)


def rendezvous(workers: list[dict], rdzv_endpoint: str, rdzv_host: int, ax=None):
    """Each torchrun as a box (left to right in the order they were started) with its agent and its workers; the
    c10d rendezvous store on the agent that hosts it (dashed: every agent joins there), the workers' store
    MASTER_ADDR:MASTER_PORT beside global rank 0 (dotted: every worker connects), and the worker pairs that
    exchange data (gloo: every pair), red where a pair is on two different nodes. Returns the axes."""
    runs = sorted({w["torchrun"] for w in workers})
    by_run = {r: sorted((w for w in workers if w["torchrun"] == r), key=lambda w: w["local_rank"]) for r in runs}
    most = max(len(v) for v in by_run.values())
    height = 2.3 + 1.25 * most
    if ax is None:
        _, ax = plt.subplots(figsize=(2.9 * len(runs) + 1.2, 0.62 * height + 0.9), dpi=100)
    pos, agent = {}, {}
    for i, r in enumerate(runs):
        x0 = i * (W + GAP)
        group = by_run[r][0]["node"]
        ax.add_patch(FancyBboxPatch((x0, 0), W, height, boxstyle="round,pad=0.1", facecolor="#f7f7f7",
                                    edgecolor="black"))
        ax.text(x0 + W / 2, height + 0.25, f"torchrun {r}: GROUP_RANK {group}", ha="center", fontsize=9,
                weight="bold")
        label = "torchrun agent" + ("\nhosts the c10d rendezvous store\n" + rdzv_endpoint if r == rdzv_host else "")
        _box(ax, x0 + 0.2, height - 1.55, W - 0.4, 1.2, label, "#fff2cc", size=7.5)
        agent[r] = (x0 + 0.2, x0 + W - 0.2, height - 0.95)   # left edge, right edge, middle height
        # Workers in a column next to the network side, so pairs across nodes and inside a node both show.
        wx = x0 + (W - 0.9 if i % 2 == 0 else 0.9)
        for k, w in enumerate(by_run[r]):
            pos[w["rank"]] = (wx, height - 2.3 - 1.25 * k)
    node_of = {w["rank"]: w["node"] for w in workers}
    backend = workers[0]["backend"]
    pairs = list(combinations(sorted(pos), 2)) if backend == "gloo" else []
    crossing = [p for p in pairs if node_of[p[0]] != node_of[p[1]]]
    for a, b in pairs:
        (xa, ya), (xb, yb) = pos[a], pos[b]
        across = (a, b) in crossing
        ax.plot([xa, xb], [ya, yb], color=CROSS if across else INSIDE, lw=2.2 if across else 1.6, zorder=1)
    # The workers' store: rank 0 hosts it on MASTER_ADDR:MASTER_PORT (the address its node advertised).
    zero = next(w for w in workers if w["rank"] == 0)
    zx, zy = pos[0]
    i0 = runs.index(zero["torchrun"])
    sx = i0 * (W + GAP) + (0.25 if i0 % 2 == 0 else W - 2.05)
    _box(ax, sx, zy - 1.05, 1.8, 0.7, "workers' store\n" + zero["master"], "#deebf7", edge=STORE, size=7)
    # Above the node boxes (zorder 1), under the worker circles (zorder 2): each line ends on the store's box, so
    # the other node's workers are seen reaching it across the network.
    for x, y in pos.values():
        ax.plot([x, sx + 1.85], [y, zy - 0.7], color=STORE, lw=1.3, ls=":", zorder=1.5)
    h_left, h_right, h_y = agent[rdzv_host]
    for r, (left, right, y) in agent.items():
        if r != rdzv_host:
            start, end = (left, h_right) if left > h_right else (right, h_left)
            ax.annotate("", xy=(end, h_y), xytext=(start, y),
                        arrowprops=dict(arrowstyle="->", color=RDZV, ls="--", lw=1.2))
    for rank, (x, y) in pos.items():
        w = next(w for w in workers if w["rank"] == rank)
        ax.add_patch(plt.Circle((x, y), 0.5, facecolor="white", edgecolor="black", zorder=2))
        ax.text(x, y, f"rank {rank}\nlocal {w['local_rank']}", ha="center", va="center", fontsize=7.5, zorder=3)
    for i in range(len(runs) - 1):
        mid = i * (W + GAP) + W + GAP / 2
        ax.axvline(mid, color=CROSS, lw=0.8, ls="--", alpha=0.6)
        ax.text(mid, -0.35, "network\nbetween nodes", ha="center", va="top", fontsize=7.5, color=CROSS)
    legend = [Line2D([], [], color=RDZV, ls="--", label="agents join the rendezvous (GROUP_RANK, MASTER_ADDR/PORT)"),
              Line2D([], [], color=STORE, ls=":", label="workers connect to their store (init_process_group)")]
    if pairs:
        inside, across = len(pairs) - len(crossing), f"{len(crossing)} of {len(pairs)}"
        legend += [Line2D([], [], color=INSIDE, lw=1.6, label=f"gloo pair inside a node ({inside})"),
                   Line2D([], [], color=CROSS, lw=2.2, label=f"gloo pair across nodes ({across})")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, fontsize=7.5, frameon=False)
    ranks_nodes = [node_of[r] for r in sorted(node_of)]
    ax.set_title(f"{len(runs)} torchruns x {most} workers, {backend}: nodes of ranks {ranks_nodes}", fontsize=9.5)
    ax.set_xlim(-0.5, len(runs) * (W + GAP) - GAP + 0.5)
    ax.set_ylim(-1.3, height + 0.7)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax
