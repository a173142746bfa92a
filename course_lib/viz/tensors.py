"""Per-rank tensor grids: what every rank held before and after a primitive (notebooks/05_collectives.ipynb).

Ranks are rows, elements are cells with their values written in. A chunk keeps its colour between panels: the
first panel's cells get a colour id each (by default, the rank that holds them), and a later cell whose value
appears in exactly one place of the first panel takes that place's colour, so a chunk can be followed from rank
to rank. A value found nowhere (a sum, a product) is drawn hatched, as a reduction of several chunks.
viz only draws what it is handed; the notebooks hand it the tensors a real run returned.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

PALETTE = plt.get_cmap("tab10").colors
REDUCED = "#d9d9d9"  # a value made of several chunks (a reduction): no single chunk's colour fits it
MIXED = -1  # colour id of a reduced / ambiguous cell


def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    return np.asarray(x, dtype=float).ravel()


def _as_rows(rows) -> list[np.ndarray | None]:
    """Each rank's tensor (or list of tensors, or None for 'holds nothing') as a flat numpy row."""
    out = []
    for row in rows:
        if row is None:
            out.append(None)
        elif isinstance(row, (list, tuple)):
            out.append(np.concatenate([_np(x) for x in row]) if row else np.zeros(0))
        else:
            out.append(_np(row))
    return out


def rank_colours(rows, by: str = "rank", chunks: int | None = None) -> list[list[int] | None]:
    """Colour ids for a first panel: by the holding rank (``by="rank"``) or by chunk position (``by="chunk"``).

    ``by="chunk"`` splits each row into ``chunks`` pieces the way ``torch.chunk`` would (default: one per rank), so
    chunk j has colour j on every rank: what reduce-scatter and scatter hand out.
    """
    rows = _as_rows(rows)
    chunks = chunks or len(rows)
    ids = []
    for r, row in enumerate(rows):
        if row is None:
            ids.append(None)
        elif by == "rank":
            ids.append([r] * len(row))
        elif by == "chunk":
            step = -(-len(row) // chunks) if len(row) else 1  # torch.chunk: ceil(n / chunks) per piece
            ids.append([min(i // step, chunks - 1) for i in range(len(row))])
        else:
            raise ValueError(f"by must be 'rank' or 'chunk', got {by!r}")
    return ids


def follow_colours(first_rows, first_ids, rows) -> list[list[int] | None]:
    """Colour ids for a later panel: a value found in exactly one chunk of the first panel keeps that chunk's colour."""
    where: dict[float, set[int]] = {}
    for row, ids in zip(_as_rows(first_rows), first_ids):
        if row is None:
            continue
        for v, c in zip(row.tolist(), ids):
            where.setdefault(v, set()).add(c)
    out = []
    for row in _as_rows(rows):
        if row is None:
            out.append(None)
            continue
        out.append([next(iter(where[v])) if len(where.get(v, ())) == 1 else MIXED for v in row.tolist()])
    return out


def _fmt(v: float) -> str:
    if float(v).is_integer() and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.3g}"


def draw_ranks(ax, rows, ids=None, title: str = "", width: int | None = None, rank_labels: Sequence[str] | None = None):
    """Draw one panel: row r is rank r's tensor, one cell per element, value written, coloured by ``ids``."""
    rows = _as_rows(rows)
    ids = ids if ids is not None else rank_colours(rows)
    n = len(rows)
    width = width or max([len(r) for r in rows if r is not None] + [1])
    for r, (row, cid) in enumerate(zip(rows, ids)):
        y = n - 1 - r
        if row is None:
            ax.text(width / 2, y + 0.5, "(nothing)", ha="center", va="center", fontsize=8, color="#888888")
            continue
        for i, (v, c) in enumerate(zip(row.tolist(), cid)):
            face = REDUCED if c == MIXED else PALETTE[c % len(PALETTE)]
            ax.add_patch(Rectangle((i, y + 0.08), 0.94, 0.84, facecolor=face, alpha=0.9 if c == MIXED else 0.55,
                                   edgecolor="#444444", linewidth=0.6, hatch="///" if c == MIXED else None))
            ax.text(i + 0.47, y + 0.5, _fmt(v), ha="center", va="center", fontsize=8 if len(_fmt(v)) < 5 else 6)
    labels = list(rank_labels) if rank_labels else [f"rank {r}" for r in range(n)]
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], labels, fontsize=8)
    ax.set_xticks([])
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(0, n)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(left=False)
    ax.set_title(title, fontsize=9)
    return ax


def rank_panels(stages, title: str = "", first_ids=None, ids=None, rank_labels=None, cell: float = 0.42):
    """One figure, one panel per stage: ``stages`` is a list of (label, rows) with rows = each rank's tensor.

    The first stage's colours are ``first_ids`` (default: by rank); later stages follow them by value unless
    ``ids`` gives their colour ids explicitly (a list with one entry per later stage, None to follow).
    Returns the figure; the notebook calls plt.show().
    """
    rows0 = _as_rows(stages[0][1])
    first_ids = first_ids if first_ids is not None else rank_colours(rows0)
    widths = [max([len(r) for r in _as_rows(rows) if r is not None] + [3]) for _, rows in stages]
    n = len(rows0)
    fig, axes = plt.subplots(1, len(stages), figsize=(cell * sum(widths) + 1.1 * len(stages), 0.35 * n + 0.8),
                             gridspec_kw={"width_ratios": [w + 1.5 for w in widths]}, dpi=100, squeeze=False)
    for k, ((label, rows), ax) in enumerate(zip(stages, axes[0])):
        if k == 0:
            these = first_ids
        elif ids is not None and ids[k - 1] is not None:
            these = ids[k - 1]
        else:
            these = follow_colours(rows0, first_ids, rows)
        draw_ranks(ax, rows, these, label, widths[k], rank_labels if k == 0 else None)
        if k:
            ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def before_after(name: str, before, after, first_ids=None, after_ids=None, rank_labels=None):
    """The standard figure of a primitive: every rank's tensor before and after ``name`` (one real run)."""
    return rank_panels([("before", before), ("after", after)], title=name, first_ids=first_ids,
                       ids=None if after_ids is None else [after_ids], rank_labels=rank_labels)
