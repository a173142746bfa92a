"""Drawings for composed parallelism (notebooks 15 and 15b): a device mesh's groups as the ranks reported them, and a
published layout's ranks placed on nodes. viz only draws what it is handed."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import PatchCollection

PALETTE = plt.get_cmap("tab10").colors


def plot_mesh_groups(coords: list[tuple[int, int]], groups: list[dict], names: tuple[str, str],
                     links: tuple[str, str], title: str = ""):
    """A 2-D mesh: every rank at its coordinate (row = first dimension, column = second), a line joining the ranks
    of each group of each dimension as the ranks reported them, and the link that dimension would use; the ranks
    of a second-dimension group drawn inside one box (one node)."""
    fig, ax = plt.subplots(figsize=(4.8, 3.6))
    rows, cols = max(c[0] for c in coords) + 1, max(c[1] for c in coords) + 1
    at = {r: (c[1], -c[0]) for r, c in enumerate(coords)}
    for i in range(rows):                                  # a node per row: the last dimension stays inside it
        ax.add_patch(plt.Rectangle((-0.35, -i - 0.42), cols, 0.72, fill=False, ec="gray", ls=":", lw=1))
        ax.text(-0.42, -i, f"node {i}", fontsize=7, color="gray", ha="right", va="center")   # outside its box
    drawn = set()
    for dim, (name, link) in enumerate(zip(names, links)):
        col = PALETTE[dim]
        for g in groups:
            members = tuple(g[name])
            if (name, members) in drawn:
                continue
            drawn.add((name, members))
            xs, ys = zip(*(at[m] for m in members))
            off = 0.06 * (1 if dim else -1)
            ax.plot(np.array(xs) + off, np.array(ys) + off, "-", color=col, lw=3, alpha=0.7,
                    label=f"{name} groups: {link}" if len([k for k in drawn if k[0] == name]) == 1 else None)
    for r, (x, y) in at.items():
        ax.add_patch(plt.Circle((x, y), 0.16, color="white", ec="k", zorder=3))
        ax.text(x, y, str(r), ha="center", va="center", fontsize=10, zorder=4)
        ax.text(x + 0.2, y - 0.2, f"{coords[r]}", ha="left", va="center", fontsize=7, color="dimgray")
    ax.set_xlim(-1.0, cols - 0.15)
    ax.set_ylim(-rows + 0.5, 0.45)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=1, frameon=False)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_layout_on_nodes(degrees: dict[str, int], placement: dict[str, dict], gpus_per_node: int, nodes: int,
                         color_by: str, label_by: str, title: str = ""):
    """Left: the first `nodes` nodes (columns) x their GPUs (rows), ranks numbered with the first key of `degrees`
    fastest; each GPU coloured by its coordinate on `color_by` and labelled with its coordinate on `label_by`.
    Right: how many nodes one group of each dimension spans (placement from mesh.place_on_nodes)."""
    names = list(degrees)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2.4, 1]})
    strides = {n: int(np.prod([degrees[m] for m in names[:i]])) for i, n in enumerate(names)}
    coord = {n: (lambda r, n=n: (r // strides[n]) % degrees[n]) for n in names}
    boxes, colours = [], []
    for node in range(nodes):
        for g in range(gpus_per_node):
            r = node * gpus_per_node + g
            boxes.append(plt.Rectangle((node, g), 0.92, 0.92))
            colours.append(PALETTE[coord[color_by](r) % 10])
            label = ax.text(node + 0.46, g + 0.46, str(coord[label_by](r)), ha="center", va="center", fontsize=6)
            label.set_in_layout(False)                      # inside the axes: tight_layout need not measure it
    # one collection, not a patch per GPU: each add_patch updates the axes' limits (half the build time at 384 GPUs)
    ax.add_collection(PatchCollection(boxes, facecolors=colours, edgecolors=colours, alpha=0.75))
    level = -0.4
    for n in names[1:]:                                     # where the first group of each outer dimension lies
        w = placement[n]
        if w["size"] == 1 or w["inside_a_node"]:
            continue
        step = int(w["node_stride"])
        if step == 1 and w["nodes_spanned"] <= nodes:       # consecutive nodes: a bracket over them
            x1 = w["nodes_spanned"] - 0.08
            ax.annotate("", (0, level), (x1, level), arrowprops={"arrowstyle": "|-|", "color": "k", "lw": 1},
                        annotation_clip=False)
            ax.text(x1 / 2, level - 0.15, f"one {n} group: {w['nodes_spanned']} consecutive nodes", ha="center",
                    va="bottom", fontsize=7)
        elif step < nodes:                                 # far apart: an arrow to the next member
            ax.annotate("", (step + 0.46, level), (0.46, level), arrowprops={"arrowstyle": "->", "color": "k"},
                        annotation_clip=False)
            ax.text(step / 2, level - 0.15, f"{n} neighbour: {step} nodes on", ha="center", va="bottom",
                    fontsize=7)
        else:
            continue
        level -= 0.9
    ax.set_xlim(0, nodes)
    ax.set_ylim(gpus_per_node, level + 0.3)
    ax.set_xticks(np.arange(0, nodes, 4) + 0.46, [str(n) for n in range(0, nodes, 4)], fontsize=7)
    ax.set_xlabel(f"node (colour: {color_by} coordinate; number: {label_by} coordinate)")
    ax.set_yticks(np.arange(gpus_per_node) + 0.46, [str(g) for g in range(gpus_per_node)], fontsize=7)
    ax.set_ylabel(f"GPU in node (= {names[0]} rank)" if degrees[names[0]] == gpus_per_node else "GPU in node")
    ax.set_title(title, fontsize=9)
    spans = [placement[n]["nodes_spanned"] for n in names]
    cols = ["tab:green" if placement[n]["inside_a_node"] else "tab:red" for n in names]
    bx.barh(range(len(names)), spans, color=cols)
    for i, n in enumerate(names):
        where = "inside one node (NVLink)" if placement[n]["inside_a_node"] else "across nodes (network)"
        bx.text(spans[i] * 1.1, i, f"{n} {degrees[n]}: {where}", va="center", fontsize=7)
    bx.set_xscale("log")
    bx.set_xlim(0.8, max(spans) * 60)
    bx.set_yticks(range(len(names)), names)
    bx.invert_yaxis()
    bx.set_xlabel("nodes one group spans")
    bx.set_title("innermost dimension first", fontsize=9)
    fig.tight_layout()
    return fig
