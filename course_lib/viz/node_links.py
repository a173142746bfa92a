"""A server's links, drawn from published tables: the `nvidia-smi topo -m` matrix as a heat map, and published
collective bus bandwidths beside the line rate of the link they ran on.

Taught in notebooks/02_cluster_architecture.ipynb. Both functions draw what they are handed: a topology parsed by
course_lib.costs.hardware.parse_nvidia_smi_topo (its legend text included), and rows of numbers from data/.
"""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

# Closest to farthest: the device itself, NVLink, then nvidia-smi's PCIe path kinds in NVML's order
# (course_lib.costs.hardware.PCIE_PATHS).
KINDS = ("X", "NV#", "PIX", "PXB", "PHB", "NODE", "SYS")
COLORS = ("#ffffff", "#2ca02c", "#e6550d", "#fdae6b", "#c6dbef", "#6baed6", "#bdbdbd")


def _kind(code: str) -> str:
    return "NV#" if code.startswith("NV") else code


def topo_matrix(topo: dict, ax=None, title: str = "nvidia-smi topo -m, drawn"):
    """Heat map of the path kind between every two devices of a parsed `nvidia-smi topo -m`; returns the axes.

    Rows of GPUs carry their NUMA node (the "NUMA Affinity" column), rows of NICs their device name (the NIC legend).
    """
    devices, gpus = topo["devices"], topo["gpus"]
    codes = [[topo["path"][a].get(b, "X") if a != b else "X" for b in devices] for a in devices]
    grid = [[KINDS.index(_kind(c)) for c in row] for row in codes]
    if ax is None:
        _, ax = plt.subplots(figsize=(7.2, 8.0), dpi=100)
    ax.imshow(grid, cmap=ListedColormap(COLORS), vmin=-0.5, vmax=len(KINDS) - 0.5)
    for i, row in enumerate(codes):
        for j, c in enumerate(row):
            ax.text(j, i, c, ha="center", va="center", fontsize=6.5,
                    color="white" if _kind(c) in ("NV#", "PIX") else "black")
    labels = []
    for d in devices:
        numa = topo["columns"].get(d, {}).get("NUMA Affinity")
        labels.append(f"{d} (NUMA {numa})" if numa is not None else f"{d} {topo['nic_names'].get(d, '')}".strip())
    ax.set_xticks(range(len(devices)), devices, rotation=90, fontsize=7)
    ax.set_yticks(range(len(devices)), labels, fontsize=7)
    ax.tick_params(top=True, labeltop=True, bottom=False, labelbottom=False)
    edge = len(gpus) - 0.5                    # between the GPU block and the NIC block
    ax.axhline(edge, color="black", lw=1)
    ax.axvline(edge, color="black", lw=1)
    used = {_kind(c) for row in codes for c in row} - {"X"}
    legend = topo.get("legend", {})
    handles = [Patch(facecolor=COLORS[KINDS.index(k)], edgecolor="gray",
                     label=textwrap.shorten(f"{k} = {legend.get(k, '')}", 110, placeholder="..."))
               for k in KINDS if k in used]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.01), fontsize=7, frameon=False)
    ax.set_title(title, fontsize=9)
    return ax


def busbw_vs_line(rows: list[dict], ax=None, title: str = "published all_reduce busbw against the link's line rate"):
    """Horizontal bars: each row's line rate (light) and published busbw (dark), with busbw / line rate written.

    rows: {"label", "busbw_GBps", "line_GBps"}; returns the axes.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 0.65 * len(rows) + 1.4), dpi=100)
    ys = range(len(rows))[::-1]
    for y, r in zip(ys, rows):
        ax.barh(y, r["line_GBps"], height=0.7, color="#d9d9d9", edgecolor="gray",
                label="line rate, one direction" if y == len(rows) - 1 else None)
        ax.barh(y, r["busbw_GBps"], height=0.35, color="#3182bd",
                label="published busbw" if y == len(rows) - 1 else None)
        ax.text(max(r["line_GBps"], r["busbw_GBps"]) * 1.01, y, f"{r['busbw_GBps'] / r['line_GBps']:.0%}",
                va="center", fontsize=8)
    ax.set_yticks(list(ys), [r["label"] for r in rows], fontsize=7.5)
    ax.set_xlabel("GB/s", fontsize=8)
    ax.set_xlim(0, max(max(r["line_GBps"], r["busbw_GBps"]) for r in rows) * 1.12)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    ax.set_title(title, fontsize=9)
    return ax
