"""Who holds which block of a weight matrix under tensor parallelism, and where 3D-parallel ranks sit in a cluster.

Notebook 13. The weight is drawn as Megatron's A (in x out, Y = X A, i.e. nn.Linear's weight transposed), so a
column split (Shoeybi et al. 2019, section 3) shows vertical stripes and a row split horizontal ones. Ownership
is found by locating each rank's real shard inside the full matrix, not assumed. viz only draws what it is handed.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle

PALETTE = plt.get_cmap("tab10").colors


def _np(t) -> np.ndarray:
    return np.asarray(t.detach().cpu() if hasattr(t, "detach") else t, dtype=float)


def ownership(full, shards, dim: int) -> np.ndarray:
    """Rank that holds each entry of `full`, found by matching every rank's shard (a slice along `dim`) in it;
    -1 where no shard matches. Raises if a shard is found nowhere (it is not a slice of this matrix)."""
    full = _np(full)
    owner = -np.ones(full.shape, dtype=int)
    for r, shard in enumerate(shards):
        shard = _np(shard)
        k = shard.shape[dim]
        for off in range(full.shape[dim] - k + 1):
            block = full[:, off:off + k] if dim == 1 else full[off:off + k, :]
            if block.shape == shard.shape and np.array_equal(block, shard):
                if dim == 1:
                    owner[:, off:off + k] = r
                else:
                    owner[off:off + k, :] = r
                break
        else:
            raise ValueError(f"rank {r}'s shard of shape {shard.shape} is not a slice of the full matrix along {dim}")
    return owner


def _panel(ax, full, owner, title, p):
    full = _np(full)
    cmap = ListedColormap([PALETTE[i % 10] for i in range(p)])
    ax.imshow(owner, cmap=cmap, vmin=-0.5, vmax=p - 0.5, aspect="equal")
    for (i, j), v in np.ndenumerate(full):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="white")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("output feature (column of A)")
    ax.set_ylabel("input feature (row of A)")
    ax.set_xticks(range(full.shape[1]))
    ax.set_yticks(range(full.shape[0]))
    ax.tick_params(labelsize=7)


def plot_weight_split(A, column_shards, row_shards, ax=None):
    """Two panels of the same A = weight.T: coloured by the rank whose column shard / row shard holds each entry."""
    p = len(column_shards)
    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    _panel(ax[0], A, ownership(A, column_shards, 1), f"column-parallel: rank r holds out-features of A ({p} ranks)",
           p)
    _panel(ax[1], A, ownership(A, row_shards, 0), f"row-parallel: rank r holds in-features of A ({p} ranks)", p)
    handles = [Rectangle((0, 0), 1, 1, color=PALETTE[r % 10]) for r in range(p)]
    ax[1].legend(handles, [f"rank {r}" for r in range(p)], loc="center left", bbox_to_anchor=(1.02, 0.5),
                 fontsize=8)
    ax[0].figure.tight_layout()
    return ax


def plot_3d_layout(layout: list[dict], gpus_per_node: int = 8, title: str = ""):
    """Three panels, one cell per GPU (nodes along x, GPU in the node along y), coloured by tensor-parallel
    group, pipeline stage and data replica; `layout` is a list of {rank, node, gpu, stage, replica, tp_rank}."""
    nodes = max(d["node"] for d in layout) + 1
    tp = max(d["tp_rank"] for d in layout) + 1
    grid = {k: np.zeros((gpus_per_node, nodes), dtype=int) for k in ("group", "stage", "replica")}
    for d in layout:
        grid["group"][d["gpu"], d["node"]] = d["rank"] // tp       # consecutive ranks form a TP group
        grid["stage"][d["gpu"], d["node"]] = d["stage"]
        grid["replica"][d["gpu"], d["node"]] = d["replica"]
    fig, axes = plt.subplots(3, 1, figsize=(11, 5.4), dpi=100, sharex=True)
    titles = {"group": f"tensor-parallel groups of {tp} (alternating shades; every group inside one node)",
              "stage": f"pipeline stage (0-{grid['stage'].max()})",
              "replica": f"data-parallel replica (0-{grid['replica'].max()})"}
    for ax, (key, g) in zip(axes, grid.items()):
        if key == "group":
            ax.imshow(g % 2, cmap=ListedColormap(["#4c72b0", "#a6c8ec"]), aspect="auto", interpolation="nearest")
        else:
            ax.imshow(g, cmap=plt.get_cmap("tab20" if g.max() >= 10 else "tab10"), aspect="auto",
                      interpolation="nearest", vmin=0, vmax=19 if g.max() >= 10 else 9)
        if key == "stage":                                          # the stage number on its block of nodes
            for st in range(g.max() + 1):
                cols = np.nonzero((g == st).any(axis=0))[0]
                ax.text(cols.mean(), (gpus_per_node - 1) / 2, str(st), ha="center", va="center", fontsize=9)
        if key == "replica" and g.max() < 10:                       # a key: which colour is which replica
            cmap = plt.get_cmap("tab10")
            ax.legend([Rectangle((0, 0), 1, 1, color=cmap(r)) for r in range(g.max() + 1)],
                      [str(r) for r in range(g.max() + 1)], title="replica", fontsize=7, title_fontsize=7,
                      loc="center left", bbox_to_anchor=(1.005, 0.5), handlelength=1, borderaxespad=0)
        for x in range(1, nodes):                                   # node boundaries
            ax.axvline(x - 0.5, color="white", lw=1.2)
        ax.set_title(titles[key], fontsize=9)
        ax.set_ylabel("GPU in node")
        ax.set_yticks([0, gpus_per_node - 1])
    axes[-1].set_xlabel(f"node (0-{nodes - 1}), {gpus_per_node} GPUs each")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
