"""Per-rank tensor grids: what every rank held before and after a primitive (notebooks/05_collectives.ipynb).

Ranks are rows, elements are cells with their values written in. The first panel gives every element a colour id
(by default the rank that holds it, or its chunk). A later panel is coloured from the provenance the run recorded
(course_lib.collectives.origins): an element copied from one place keeps that place's colour; an element combined
from several (a sum) is hatched, in their colour if they all had one, grey if they did not; an element the call did
not write is white with a dashed edge. Colours never come from matching values: two equal numbers may have
different histories. viz only draws what it is handed; the notebooks hand it what a real run returned.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

from course_lib.collectives.origins import sources

# tab10 without its grey (index 7): grey means "combined from different colours" here.
PALETTE = tuple(c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7)
REDUCED = "#bdbdbd"  # combined from elements of different colours: no single colour fits
MIXED = -1           # colour id of such an element
UNWRITTEN = -2       # colour id of an element no rank wrote in this call (its buffer's initial value)
HATCH = "////"


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


def _tag_rows(rows) -> list[list[int] | None]:
    """Provenance tags (int64 bit masks) as exact Python ints, row by row (floats would lose high bits)."""
    out = []
    for row in rows:
        if row is None:
            out.append(None)
            continue
        parts = row if isinstance(row, (list, tuple)) else [row]
        out.append([int(v) for t in parts for v in (t.reshape(-1).tolist() if hasattr(t, "reshape") else t)])
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


def colours_from_origins(first_ids, origin_rows, width: int):
    """(colour ids, combined flags) of a later panel from the tags `origins` recorded in the same run.

    width is L, the longest first-panel row (the tags' layout: bit r*L + i = element i of rank r). An element whose
    sources all have colour c gets c, else MIXED; no source at all gives UNWRITTEN; combined = more than one source.
    """
    ids, combined = [], []
    for row in _tag_rows(origin_rows):
        if row is None:
            ids.append(None)
            combined.append(None)
            continue
        ids_row, comb_row = [], []
        for tag in row:
            src = sources(tag, width) if tag > 0 else []
            colours = {first_ids[r][i] for r, i in src if first_ids[r] is not None and i < len(first_ids[r])}
            if len(src) != sum(1 for r, i in src if first_ids[r] is not None and i < len(first_ids[r])):
                raise ValueError(f"tag {tag} names an element the first panel does not show: pass the first panel "
                                 "the very tensors that origins() tagged")
            ids_row.append(UNWRITTEN if not src else colours.pop() if len(colours) == 1 else MIXED)
            comb_row.append(len(src) > 1)
        ids.append(ids_row)
        combined.append(comb_row)
    return ids, combined


def _fmt(v: float) -> str:
    if float(v).is_integer() and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.3g}"


def draw_ranks(ax, rows, ids=None, title: str = "", width: int | None = None,
               rank_labels: Sequence[str] | None = None, combined=None):
    """Draw one panel: row r is rank r's tensor, one cell per element, value written, coloured by ``ids``.

    ``combined`` (same shape as ids, optional) marks elements made of several sources: hatched, with the value on a
    white label so the hatching never hides it.
    """
    rows = _as_rows(rows)
    ids = ids if ids is not None else rank_colours(rows)
    n = len(rows)
    width = width or max([len(r) for r in rows if r is not None] + [1])
    for r, (row, cid) in enumerate(zip(rows, ids)):
        y = n - 1 - r
        if row is None:
            ax.text(width / 2, y + 0.5, "(nothing)", ha="center", va="center", fontsize=8, color="#888888")
            continue
        comb = combined[r] if combined is not None and combined[r] is not None else [False] * len(row)
        for i, (v, c, many) in enumerate(zip(row.tolist(), cid, comb)):
            box = (i, y + 0.08)
            if c == UNWRITTEN:
                ax.add_patch(Rectangle(box, 0.94, 0.84, facecolor="white", edgecolor="#777777", linewidth=0.8,
                                       linestyle="--"))
            else:
                face = REDUCED if c == MIXED else PALETTE[c % len(PALETTE)]
                ax.add_patch(Rectangle(box, 0.94, 0.84, facecolor=face, alpha=0.9 if c == MIXED else 0.55,
                                       edgecolor="#444444", linewidth=0.6))
            if many:  # the hatch on top of the fill, in a light line so it stays a texture
                ax.add_patch(Rectangle(box, 0.94, 0.84, fill=False, hatch=HATCH, edgecolor="#555555",
                                       linewidth=0.0, alpha=0.6))
            label = _fmt(v)
            ax.text(i + 0.47, y + 0.5, label, ha="center", va="center", fontsize=8 if len(label) < 5 else 6,
                    zorder=5, bbox=dict(boxstyle="round,pad=0.12", facecolor="white", edgecolor="none", alpha=0.85)
                    if many else None)
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


def _legend_handles(styles) -> list:
    """One legend entry per kind of provenance that appears in the figure."""
    kinds = set()
    for ids, comb in styles:
        for row_ids, row_comb in zip(ids, comb or [None] * len(ids)):
            for k, c in enumerate(row_ids or []):
                many = bool(row_comb and row_comb[k])
                kinds.add("unwritten" if c == UNWRITTEN else "mixed" if c == MIXED else "combined" if many else "copy")
    handles = []
    if "copy" in kinds:
        handles.append(Patch(facecolor=PALETTE[0], alpha=0.55, edgecolor="#444444",
                             label="colours: each rank's in before; a copied element keeps its source's"))
    if "combined" in kinds:
        handles.append(Patch(facecolor=PALETTE[0], alpha=0.55, edgecolor="#444444", hatch=HATCH,
                             label="hatched: combined from several elements of that colour"))
    if "mixed" in kinds:
        handles.append(Patch(facecolor=REDUCED, edgecolor="#444444", hatch=HATCH,
                             label="grey: combined from elements of different colours"))
    if "unwritten" in kinds:
        handles.append(Patch(facecolor="white", edgecolor="#777777", linestyle="--",
                             label="white: not written by this call"))
    return handles


def rank_panels(stages, title: str = "", first_ids=None, ids=None, origins=None, rank_labels=None,
                cell: float = 0.42):
    """One figure, one panel per stage: ``stages`` is a list of (label, rows) with rows = each rank's tensor.

    The first stage's colours are ``first_ids`` (default: by rank). Every later stage needs either ``origins``
    (a list with one entry per later stage: the tags course_lib.collectives.origins recorded for it in the same run)
    or explicit ``ids`` (for pictures that are not a data flow, e.g. times or a table); one of the two per stage.
    Returns the figure; the notebook calls plt.show().
    """
    rows0 = _as_rows(stages[0][1])
    first_ids = first_ids if first_ids is not None else rank_colours(rows0)
    later = len(stages) - 1
    ids = list(ids) if ids is not None else [None] * later
    origins = list(origins) if origins is not None else [None] * later
    if len(ids) != later or len(origins) != later:
        raise ValueError(f"give one entry of ids/origins per later stage ({later}), None where the other applies")
    width0 = max([len(r) for r in rows0 if r is not None] + [0])
    styles = []
    for k in range(later):
        if origins[k] is not None:
            styles.append(colours_from_origins(first_ids, origins[k], width0))
        elif ids[k] is not None:
            styles.append((ids[k], None))
        else:
            raise ValueError(f"stage {k + 1} ({stages[k + 1][0]!r}) has neither origins nor ids: colours come from "
                             "the data flow a run recorded (course_lib.collectives.origins), never from equal values")
    handles = _legend_handles([s for s, o in zip(styles, origins) if o is not None])
    widths = [max([len(r) for r in _as_rows(rows) if r is not None] + [3]) for _, rows in stages]
    n = len(rows0)
    legend_h = 0.22 * len(handles) if handles else 0.0
    fig, axes = plt.subplots(1, len(stages), figsize=(cell * sum(widths) + 1.1 * len(stages),
                                                      0.35 * n + 0.8 + legend_h),
                             gridspec_kw={"width_ratios": [w + 1.5 for w in widths]}, dpi=100, squeeze=False)
    for k, ((label, rows), ax) in enumerate(zip(stages, axes[0])):
        these, comb = (first_ids, None) if k == 0 else styles[k - 1]
        draw_ranks(ax, rows, these, label, widths[k], rank_labels if k == 0 else None, combined=comb)
        if k:
            ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=10)
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=1, fontsize=7, frameon=False)
        fig.tight_layout(rect=(0, legend_h / fig.get_figheight(), 1, 1))
    else:
        fig.tight_layout()
    return fig


def before_after(name: str, before, after, origins=None, first_ids=None, after_ids=None, rank_labels=None):
    """The standard figure of a primitive: every rank's tensor before and after ``name`` (one real run).

    ``origins`` are the tags recorded for ``after`` by course_lib.collectives.origins in the same run; ``after_ids``
    colours it explicitly instead.
    """
    return rank_panels([("before", before), ("after", after)], title=name, first_ids=first_ids,
                       ids=[after_ids], origins=[origins], rank_labels=rank_labels)
