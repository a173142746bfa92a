"""Drawings for ring attention (notebook 15b): whose key/value block each rank holds at each step and which it
skipped under a causal mask, the work per rank for two layouts, and when the ring's transfers hide behind compute
(the model, and a run's step times on an emulated link). viz only draws what a run (or the cost model) returned."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

PALETTE = plt.get_cmap("tab10").colors


def _schedule(ax, steps, title):
    p = len(steps)
    for r, row in enumerate(steps):
        for t, (src, done) in enumerate(row):
            ax.add_patch(plt.Rectangle((t, r), 0.95, 0.9, color=PALETTE[src % 10], alpha=1.0 if done else 0.15,
                                       hatch=None if done else "//"))
            ax.text(t + 0.47, r + 0.45, f"K,V of {src}" + ("" if done else "\nskipped"), ha="center",
                    va="center", fontsize=7)
    ax.set_xlim(0, len(steps[0]))
    ax.set_ylim(p, 0)
    ax.set_xticks(np.arange(len(steps[0])) + 0.47, [f"step {t}" for t in range(len(steps[0]))], fontsize=7)
    ax.set_yticks(np.arange(p) + 0.45, [f"rank {r}" for r in range(p)], fontsize=8)
    ax.set_title(title, fontsize=9)


def plot_ring_schedule(schedules: dict[str, list], work: dict[str, list] | None = None):
    """One panel per run: schedules[name] = per rank, per step (whose K/V block, computed?); work[name] = (query,
    key) pairs per rank, drawn as bars in a last panel."""
    n = len(schedules) + (1 if work else 0)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 2.9))
    axes = np.atleast_1d(axes)
    for ax, (name, steps) in zip(axes, schedules.items()):
        _schedule(ax, steps, name)
    if work:
        ax = axes[-1]
        p = len(next(iter(work.values())))
        width = 0.8 / len(work)
        for i, (name, w) in enumerate(work.items()):
            ax.bar(np.arange(p) + i * width, w, width, label=name)
        ax.set_xticks(np.arange(p) + 0.4 - width / 2, [f"rank {r}" for r in range(p)], fontsize=8)
        ax.set_ylabel("visible (query, key) pairs", fontsize=8)
        ax.set_title("causal work per rank", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_overlap(curves: dict[str, dict], c, crossovers: dict[str, float], title: str = ""):
    """Time per ring step against block length c: compute (the same for every link) and each link's transfer;
    with overlap a step takes the larger of the two. crossovers[name]: the c where they meet."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    c = np.asarray(c)
    first = next(iter(curves.values()))
    ax.loglog(c, np.asarray(first["compute"]) * 1e3, "k-", lw=2, label="compute per step (4 c² d / F)")
    for i, (name, cur) in enumerate(curves.items()):
        col = PALETTE[i % 10]
        ax.loglog(c, np.asarray(cur["transfer"]) * 1e3, "--", color=col, label=f"K/V transfer over {name}")
        x = crossovers[name]
        ax.axvline(x, color=col, lw=0.8, alpha=0.6)
        ax.text(x, np.asarray(first["compute"]).min() * 1e3 * 2, f" c = {x:,.0f}",
                color=col, rotation=90, fontsize=7, va="bottom")
    ax.set_xlabel("tokens per rank c = S / p")
    ax.set_ylabel("ms per ring step")
    ax.set_title(title or "transfer hides behind compute right of each line", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    return fig


def plot_step_slowdown(c, measured: dict[str, dict], model: dict[str, dict], crossovers: dict[str, float],
                       title: str = ""):
    """One ring step's time over its compute time against block length c, per link: measured[name] = {"overlap":
    step seconds, "serial": step seconds} from a run, model[name] = overlap_model(...) for the same c (lines).
    With the transfer posted before the compute the ratio reaches 1 at the crossover and stays there; waiting
    first, it is 1 + transfer / compute."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    c = np.asarray(c, dtype=float)
    for i, (name, got) in enumerate(measured.items()):
        col, mod = PALETTE[i % 10], model[name]
        comp = np.asarray(mod["compute"])
        ax.loglog(c, np.asarray(mod["overlapped"]) / comp, "-", color=col, lw=1.2)
        ax.loglog(c, np.asarray(mod["serial"]) / comp, ":", color=col, lw=1.2)
        ax.loglog(c, np.asarray(got["overlap"]) / comp, "o", color=col, ms=6,
                  label=f"{name}: send posted before compute")
        ax.loglog(c, np.asarray(got["serial"]) / comp, "x", color=col, ms=7, mew=1.5,
                  label=f"{name}: wait, then compute")
        ax.axvline(crossovers[name], color=col, lw=0.8, alpha=0.6,
                   label=f"{name}: crossover c = b F / (2B) = {crossovers[name]:,.0f}")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xlabel("tokens per rank c")
    ax.set_ylabel("step time / compute time")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    return fig
