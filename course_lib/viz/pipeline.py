"""Pipeline schedules, bubbles, activation memory, gradient ranges and parallel layouts, drawn (notebooks 14 and 14b).

Draws what it is handed (course_lib.training.pipeline schedules and timelines, measured bytes, the calculator's
plans); launches nothing.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

F_COLOR, B_COLOR, WAIT_COLOR = "#8ecae6", "#1d4e89", "#f4a3a3"


def plot_schedule(per_stage: list, title: str = "", unit: str = "ms", waits: list | None = None, ax=None):
    """One row per stage: forwards (light) and backwards (dark) as boxes labelled with their micro-batch, from
    [(kind, i, start, end)] per stage (times in seconds when unit="ms", in slots when unit="slots"); `waits`:
    per stage [(start, end)] drawn as thin red bars under the row (time spent waiting in a recv)."""
    n = len(per_stage)
    scale = 1e3 if unit == "ms" else 1.0
    end = max(e for acts in per_stage for *_, e in acts) * scale
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 * n + 1.1), dpi=100)
    for s, acts in enumerate(per_stage):
        for kind, i, a, b in acts:
            ax.broken_barh([(a * scale, (b - a) * scale)], (s + 0.08, 0.7), color=F_COLOR if kind == "F" else B_COLOR,
                           edgecolor="white", lw=0.5)
            if (b - a) * scale > end / 90:
                ax.text((a + b) / 2 * scale, s + 0.43, str(i), ha="center", va="center", fontsize=7,
                        color="black" if kind == "F" else "white")
        for a, b in (waits[s] if waits else []):
            ax.broken_barh([(a * scale, (b - a) * scale)], (s + 0.8, 0.12), color=WAIT_COLOR, lw=0)
    ax.set_yticks([s + 0.45 for s in range(n)], [f"stage {s}" for s in range(n)])
    ax.set_ylim(n, 0)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("time since the barrier (ms)" if unit == "ms" else "time (slots: forward 1, backward 2)")
    handles = [Patch(color=F_COLOR, label="forward i"), Patch(color=B_COLOR, label="backward i")]
    if waits:
        handles.append(Patch(color=WAIT_COLOR, label="waiting in recv"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.figure.tight_layout()
    return ax


def plot_bubble(rows: list, title: str = ""):
    """Bubble fraction against micro-batches m: the formula (p-1)/(m+p-1) as lines, each row of `rows`
    ({"p", "schedule", "m", "measured"}, optionally "replayed") a marker (circle GPipe, cross 1F1B, each a little
    to one side of its m) and, when given, a short bar at the bubble its order gives replayed with the run's
    measured costs."""
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=100)
    ps = sorted({r["p"] for r in rows})
    ms = sorted({r["m"] for r in rows})
    grid = [x / 4 for x in range(4, 4 * max(ms) + 1)]
    shift = {"gpipe": 1 / 1.06, "1f1b": 1.06}
    for k, p in enumerate(ps):
        color = f"C{k}"
        ax.plot(grid, [(p - 1) / (x + p - 1) for x in grid], color=color, lw=1.2, label=f"(p-1)/(m+p-1), p = {p}")
        for sched, marker in (("gpipe", "o"), ("1f1b", "x")):
            mine = [r for r in rows if r["p"] == p and r["schedule"] == sched]
            if not mine:
                continue
            xs = [r["m"] * shift[sched] for r in mine]
            ax.plot(xs, [r["measured"] for r in mine], marker, color=color, ms=7,
                    mfc="none" if marker == "o" else color,
                    label=f"wall clock, p = {p}, {'GPipe' if sched == 'gpipe' else '1F1B'}")
            if all("replayed" in r for r in mine):
                ax.plot(xs, [r["replayed"] for r in mine], "_", color=color, ms=13, mew=2)
    if any("replayed" in r for r in rows):
        ax.plot([], [], "_", color="0.3", ms=13, mew=2, label="recorded order + measured hand-off costs")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches per step, m")
    ax.set_ylabel("bubble: share of the step a stage idles")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_in_flight(measured: dict, formula: dict, unit: float = 1e3, title: str = ""):
    """Peak activation bytes per stage, one group of bars per schedule (measured filled, formula dashed outline):
    measured/formula = {schedule: [bytes of stage 0, 1, ...]}."""
    fig, ax = plt.subplots(figsize=(7.5, 3.2), dpi=100)
    width = 0.8 / len(measured)
    for k, sched in enumerate(measured):
        xs = [s + (k - (len(measured) - 1) / 2) * width for s in range(len(measured[sched]))]
        ax.bar(xs, [b / unit for b in measured[sched]], width * 0.9, color=f"C{k}", label=f"{sched} (measured)")
        ax.bar(xs, [b / unit for b in formula[sched]], width * 0.9, fill=False, ls="--", edgecolor="black")
    ax.bar([0], [0], fill=False, ls="--", edgecolor="black", label="formula: in flight x one micro-batch")
    n = len(next(iter(measured.values())))
    ax.set_xticks(range(n), [f"stage {s}" for s in range(n)])
    ax.set_ylabel("peak activations kept (kB)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_gradient_range(values, formats: dict, scale: float, title: str = ""):
    """Histogram of log2 |gradient| (non-zero entries) and the same shifted by log2(scale), with each format's
    smallest subnormal, smallest normal and largest value as vertical lines named in the legend (Micikevicius et al.
    2018, figure 3)."""
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    logs = values[values != 0].abs().log2()
    bins = [x / 2 for x in range(-80, 40)]
    ax.hist(logs.tolist(), bins=bins, color="C0", alpha=0.7, label="activation gradients (fp32 run)")
    shift = math.log2(scale)
    ax.hist((logs + shift).tolist(), bins=bins, color="C2", alpha=0.5, label=f"x {scale:g} (loss scaled)")
    for k, (name, f) in enumerate(formats.items()):
        for key, ls, what in (("min_subnormal", ":", "smallest subnormal"), ("min_normal", "--", "smallest normal"),
                              ("max", "-", "largest")):
            ax.axvline(math.log2(f[key]), color=f"C{3 + k}", ls=ls, lw=1.2,
                       label=f"{name} {what}, {f[key]:.3g}")
    ax.set_xlabel("log2 |value|")
    ax.set_ylabel("entries")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_layouts(plans: list, gpu_memory_gb: float, mark=None, title: str = "", top: int = 12):
    """The `top` fastest layouts (calculator plans): memory per GPU as stacked bars (model states, activations)
    against the GPU's memory, and the estimated step time on a second axis; `mark` (tp, pp, dp) is outlined."""
    shown = sorted(plans, key=lambda r: r["time"]["total"])[:top]
    if mark is not None:
        shown += [r for r in plans if (r["layout"].tp, r["layout"].pp, r["layout"].dp) == mark and r not in shown]
    fig, ax = plt.subplots(figsize=(10, 3.8), dpi=100)
    xs = range(len(shown))
    states = [r["states"] / 1e9 for r in shown]
    acts = [r["activations"] / 1e9 for r in shown]
    ax.bar(xs, states, color="#4c72b0", label="weights + gradients + optimizer")
    ax.bar(xs, acts, bottom=states, color="#dd8452", label="activations (first stage)")
    ax.axhline(gpu_memory_gb, color="C3", ls="--", lw=1, label=f"GPU memory {gpu_memory_gb:g} GB")
    for x, r in zip(xs, shown):
        lay = r["layout"]
        if mark is not None and (lay.tp, lay.pp, lay.dp) == mark:
            ax.bar([x], [states[x] + acts[x]], fill=False, edgecolor="black", lw=2)
    ax.set_xticks(list(xs), [f"TP{r['layout'].tp}\nPP{r['layout'].pp}\nDP{r['layout'].dp}" for r in shown],
                  fontsize=7)
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_ylim(0, max(gpu_memory_gb * 1.6, max(s + a for s, a in zip(states, acts)) * 1.05))
    ax2 = ax.twinx()
    ax2.plot(list(xs), [r["time"]["total"] for r in shown], "ko-", ms=4, lw=1, label="step time (s)")
    ax2.set_ylabel("estimated step time (s)")
    ax2.set_ylim(0, max(r["time"]["total"] for r in shown) * 1.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
