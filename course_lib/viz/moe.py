"""Drawings for expert parallelism (notebook 15): who sent how many tokens to which expert, what a capacity factor
drops, and how the load-balancing loss spreads the router's choices. viz only draws what a run returned."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np


def plot_token_flow(sent, experts_per_rank: int, capacity: int | None = None, dropped=None, title: str = ""):
    """Left: tokens each source rank (row) sent to each expert (column), columns grouped by the rank holding them,
    a rank's own experts outlined (those rows stay on the rank); right: tokens each expert received in all,
    against its capacity per source (x p ranks), and dropped tokens."""
    sent = np.asarray(sent)
    p, e = sent.shape
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.4), gridspec_kw={"width_ratios": [1.2, 1]})
    im = ax.imshow(sent, cmap="Blues", aspect="auto")
    for (i, j), v in np.ndenumerate(sent):
        ax.text(j, i, str(v), ha="center", va="center", fontsize=8,
                color="white" if v > sent.max() * 0.6 else "black")
    for b in range(1, p):
        ax.axvline(b * experts_per_rank - 0.5, color="k", lw=1.5)
    for i in range(p):            # a rank's rows for its own experts: a local copy, no bytes on a link
        ax.add_patch(plt.Rectangle((i * experts_per_rank - 0.45, i - 0.45), experts_per_rank - 0.1, 0.9,
                                   fill=False, ec="tab:orange", lw=2.5, ls="--"))
    ax.set_xticks(range(e), [f"e{j}\n(rank {j // experts_per_rank})" for j in range(e)], fontsize=7)
    ax.set_yticks(range(p), [f"rank {i}" for i in range(p)])
    ax.set_xlabel("expert (and the rank holding it)")
    ax.set_ylabel("tokens from")
    ax.set_title("tokens sent to each expert (kept ones);\ndashed: the rank's own expert, a local copy", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    total = sent.sum(0)
    bx.bar(range(e), total, color="tab:blue", label="kept")
    if dropped is not None:
        bx.bar(range(e), np.asarray(dropped), bottom=total, color="tab:red", label="dropped (over capacity)")
    if capacity is not None:
        bx.axhline(capacity * p, color="k", ls="--", lw=1, label=f"capacity x {p} ranks = {capacity * p}")
    bx.axhline(total.sum() / e if dropped is None else (total.sum() + np.sum(dropped)) / e, color="tab:green",
               ls=":", lw=1.5, label="perfectly balanced")
    bx.set_xticks(range(e), [f"e{j}" for j in range(e)])
    bx.set_ylabel("tokens")
    bx.set_title("per expert, over all ranks", fontsize=9)
    bx.legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_router_balance(results: list[dict]):
    """One panel per train_router result: share of tokens whose first choice is each expert, before and after."""
    fig, axes = plt.subplots(1, len(results), figsize=(3.6 * len(results), 3), sharey=True)
    for ax, r in zip(np.atleast_1d(axes), results):
        e = len(r["after"])
        x = np.arange(e)
        ax.bar(x - 0.2, r["before"], 0.4, color="lightgray", label="untrained router")
        ax.bar(x + 0.2, r["after"], 0.4, color="tab:blue", label="after training")
        ax.axhline(1 / e, color="tab:green", ls=":", label="balanced (1/E)")
        spread = max(r["after"]) * e
        ax.set_title(f"alpha = {r['alpha']}: busiest expert {spread:.1f}x its share\ntask loss {r['task_loss']:.3f}",
                     fontsize=9)
        ax.set_xticks(x, [f"e{j}" for j in x], fontsize=7)
        ax.set_xlabel("expert")
    np.atleast_1d(axes)[0].set_ylabel("share of tokens (first choice)")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    return fig
