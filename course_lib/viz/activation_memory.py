"""Drawings of activation memory measured in notebook 14b: bytes alive over a training step, and bytes kept for
backward against the sequence length."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt

# name -> (colour, line style, drawing order): "full" dashed and on top, since a policy may end its step on exactly the
# same bytes and would hide it; other policies above "none", so that their own peaks stay visible
_STYLE = {"none": ("tab:red", "-", 2), "full": ("tab:blue", "--", 4)}


def plot_step_memory(timelines: dict, kept_by_s: dict, title: str = ""):
    """Left: {name: (bytes alive after each op, index of forward's last op)} over one step. Right: {name: {s: bytes
    kept for backward}} on log-log axes, each line labelled with its slope between its last two points (1: grows
    like s, 2: like s²)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, (name, (timeline, end)) in enumerate(timelines.items()):
        color, ls, z = _STYLE.get(name, (f"C{i + 2}", "-", 3))
        left.plot(range(1, len(timeline) + 1), [v / 1e6 for v in timeline], color=color, ls=ls, zorder=z, label=name)
        left.plot(end, timeline[end - 1] / 1e6, "o", color=color, zorder=z)
    left.plot([], [], "ok", label="end of forward")
    left.set(xlabel="ops run in the step (forward, then backward)", ylabel="MB alive",
             title="bytes the step holds, op by op")
    left.legend(fontsize=8)
    for i, (name, kept) in enumerate(kept_by_s.items()):
        color, ls, z = _STYLE.get(name, (f"C{i + 2}", "-", 3))
        s = sorted(kept)
        slope = math.log(kept[s[-1]] / kept[s[-2]]) / math.log(s[-1] / s[-2])
        right.loglog(s, [kept[x] / 1e6 for x in s], "o", color=color, ls=ls, zorder=z,
                     label=f"{name}: slope {s[-2]}→{s[-1]} {slope:.2f}")
    right.set_xscale("log", base=2)
    right.set(xlabel="sequence length s", ylabel="MB kept for backward", title="kept at the end of forward")
    right.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
