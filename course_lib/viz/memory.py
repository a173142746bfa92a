"""Per-rank memory by category for each data-parallel scheme: measured bars next to the formula (notebook 12).

Draws what course_lib.measure.memory measured on real ranks and what its formulas say (ZeRO paper, figure 1).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state (Adam m, v)"}


def memory_bars(measured: dict, formula: dict, title: str, unit: float = 1e3, unit_name: str = "kB"):
    """measured / formula = {scheme: {"params", "grads", "optimizer": bytes}}: one stacked bar per scheme (measured,
    filled) and beside it the formula's stack as dashed outlines; the measured total is written on top."""
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
    schemes = list(measured)
    for i, s in enumerate(schemes):
        for x, src, filled in ((i - 0.19, measured[s], True), (i + 0.19, formula[s], False)):
            bottom = 0.0
            for c in COLORS:
                h = src[c] / unit
                if filled:
                    ax.bar(x, h, 0.36, bottom=bottom, color=COLORS[c])
                else:
                    ax.bar(x, h, 0.36, bottom=bottom, fill=False, edgecolor=COLORS[c], ls="--", lw=1.2)
                bottom += h
            if filled:
                ax.text(x, bottom, f"{bottom:,.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(schemes)), [f"{s}\n(measured | formula)" for s in schemes], fontsize=8)
    ax.set_ylabel(f"bytes held per rank ({unit_name})")
    ax.set_title(title, fontsize=9)
    handles = [Patch(color=COLORS[c], label=LABELS[c]) for c in COLORS]
    handles.append(Patch(fill=False, edgecolor="gray", ls="--",
                         label="formula (ZeRO paper's, for fp32 Adam, padding counted)"))
    ax.legend(handles=handles, fontsize=7, loc="upper right")
    ax.margins(y=0.12)
    fig.tight_layout()
    return fig
