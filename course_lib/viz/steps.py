"""Step-by-step drawings of a recorded collective (course_lib.collectives.Trace merged with `merge`).

Taught in notebooks/06_build_your_own_collectives.ipynb. One panel per step: a grid of ranks (rows) by chunks
(columns) holding what each rank's buffer held after that step, and an arrow for every chunk sent in that step.
Static small multiples always render (GitHub, nbval, HTML); a slider over `draw_step` is an extra for live kernels.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.colors import Normalize


def _default_cell(values):
    v = values[0].item() if values.numel() else 0
    return f"{v:g}", float(v)


def draw_step(step: dict, chunks, ax=None, cell=None, vmax: float | None = None, title: str | None = None):
    """One step: ranks x chunks grid coloured by cell(values)[1], labelled by cell(values)[0], sends as arrows.

    `cell(values_of_one_chunk) -> (text, number)`; the default shows the chunk's first value.
    """
    ax = ax or plt.gca()
    cell = cell or _default_cell
    bufs = step["buffers"]
    p, k = len(bufs), len(chunks)
    cells = [[cell(b[lo:hi]) for lo, hi in chunks] for b in bufs]
    top = vmax if vmax is not None else max((c[1] for row in cells for c in row), default=1) or 1
    norm, cmap = Normalize(0, top), plt.get_cmap("Blues")
    for r in range(p):
        for c in range(k):
            text, num = cells[r][c]
            ax.add_patch(plt.Rectangle((c, r), 0.94, 0.9, color=cmap(0.15 + 0.75 * norm(num))))
            ax.text(c + 0.47, r + 0.45, text, ha="center", va="center", fontsize=7,
                    color="white" if norm(num) > 0.6 else "black")
    for src, dst, chunk, _ in step["sends"]:
        x = chunk + 0.85
        bend = 0.5 if abs(dst - src) > 1 else 0.25
        ax.annotate("", xy=(x, dst + 0.45), xytext=(x, src + 0.45),
                    arrowprops=dict(arrowstyle="->", color="tab:red", lw=1.2,
                                    connectionstyle=f"arc3,rad={bend if dst > src else -bend}"))
    ax.set_xlim(-0.1, k + 0.3)
    ax.set_ylim(p, -0.1)
    ax.set_yticks([r + 0.45 for r in range(p)], [f"rank {r}" for r in range(p)], fontsize=7)
    ax.set_xticks([c + 0.47 for c in range(k)], [f"c{c}" for c in range(k)] if k > 1 else ["tensor"], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title or step["phase"], fontsize=8)
    return ax


def plot_steps(steps: list[dict], chunks, cell=None, cols: int = 4, title: str | None = None, size: float = 2.1):
    """Small multiples: every step of a merged trace, in order, on one static figure."""
    n = len(steps)
    cols = min(cols, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * 0.9 * rows), dpi=100, squeeze=False)
    cell = cell or _default_cell
    vmax = max(cell(b[lo:hi])[1] for s in steps for b in s["buffers"] for lo, hi in chunks) or 1
    for i, ax in enumerate(axes.flat):
        if i < n:
            label = "start" if i == 0 else f"step {i}: {steps[i]['phase']}"
            draw_step(steps[i], chunks, ax=ax, cell=cell, vmax=vmax, title=label)
        else:
            ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
