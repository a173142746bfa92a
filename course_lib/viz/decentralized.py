"""Figures of notebooks 11 and 11b (decentralized training), drawn from the measurements handed in."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator, NullFormatter

COLORS = {"ring": "C0", "torus": "C2", "exponential": "C1", "one-peer exponential": "C4", "complete": "C7"}


def consensus(measured: dict, rhos: dict, gaps: dict | None = None, ps=None, title: str = ""):
    """Left: squared consensus distance per gossip round, measured (dots) against the bound rho^(2t) times the start
    (dashed); right (when gaps is given): spectral gap against the number of ranks, log-log."""
    fig, axes = plt.subplots(1, 2 if gaps else 1, figsize=(10 if gaps else 5.2, 3.4), dpi=100, squeeze=False)
    ax = axes[0][0]
    for topo, xs in measured.items():
        c = COLORS.get(topo, None)
        rounds = range(len(xs))
        ax.semilogy(rounds, [max(x, 1e-30) for x in xs], "o-", ms=3, color=c, label=f"{topo} (measured)")
        ax.semilogy(rounds, [xs[0] * rhos[topo] ** (2 * t) for t in rounds], "--", color=c, lw=1)
    ax.set_ylim(bottom=max(1e-12, min(min(x for x in xs if x > 0) for xs in measured.values()) / 10))
    ax.set_xlabel("gossip round")
    ax.set_ylabel("Ξ² = (1/p) Σᵢ ‖xᵢ − x̄‖²")
    ax.set_title(title or r"replicas agreeing: measured (dots), bound $\rho^{2t}\,\Xi_0^2$ (dashed)", fontsize=9)
    ax.legend(fontsize=7)
    if gaps:
        ax = axes[0][1]
        for topo, g in gaps.items():
            ax.loglog(ps, g, "o-", ms=3, color=COLORS.get(topo), label=topo)
        ax.set_xlabel("ranks p (log)")
        ax.set_xticks(list(ps), [str(p) for p in ps])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("spectral gap 1 − ρ (log)")
        ax.set_title("spectral gap from the mixing matrix (torch.linalg)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def dpsgd(runs: dict, title: str = "", levels: dict | None = None, since: int = 0):
    """Squared consensus distance (left) and training loss (right) per step of decentralized SGD, one line per
    topology; `levels` {topology: (value, label)} draws a dashed level from step `since` on."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2), dpi=100)
    for topo, r in runs.items():
        c = COLORS.get(topo)
        a.plot(r["consensus"], color=c, label=topo)
        if levels and topo in levels:
            value, label = levels[topo]
            a.plot([since, len(r["consensus"]) - 1], [value, value], "--", color=c, lw=1, label=label)
        b.plot(r["losses"], color=c, label=topo, lw=1)
    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))     # steps are whole numbers
    a.set_xlabel("step")
    a.set_ylabel("Ξ² after the step's gossip round")
    a.set_title(title or "how far apart the replicas are after each step", fontsize=9)
    a.set_ylim(0, 1.4 * max(max(r["consensus"]) for r in runs.values()))    # room for the legend on top
    a.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    a.legend(fontsize=7, ncol=2, loc="upper left")
    b.set_xlabel("step")
    b.set_ylabel("rank 0's training loss")
    b.set_title("loss on rank 0's batches", fontsize=9)
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def local_sgd(curves: dict, link_name: str):
    """Loss on all digits against bytes each rank sent (left, log) and against training seconds (right), one curve
    per configuration: {label: [(step, bytes sent, seconds, loss, accuracy), ...]}."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4), dpi=100)
    for i, (label, pts) in enumerate(curves.items()):
        c = f"C{i}"
        sent = [p for p in pts if p[1] > 0]          # a log axis has no 0: the start is in the right panel
        a.semilogx([p[1] / 1e6 for p in sent], [p[3] for p in sent], "o-", ms=3, color=c, label=label)
        b.plot([p[2] for p in pts], [p[3] for p in pts], "o-", ms=3, color=c, label=label)
    a.set_xlabel("MB sent by each rank so far (log)")
    b.set_xlabel(f"seconds of training so far (virtual clock: compute + emulated {link_name})")
    for ax in (a, b):
        ax.set_ylabel("loss on all digits")
    b.legend(fontsize=7)        # one legend: the colours are the same in both panels
    a.set_title("loss against bytes", fontsize=9)
    b.set_title("loss against time", fontsize=9)
    fig.tight_layout()
    return fig


def compression(rows: list[dict], full_bytes: float, full_loss: float):
    """Final loss against bytes each worker sends per step (log), one point per compressor ({name, bytes, loss}),
    and all-reduce data parallel's (full_bytes, full_loss) as the star to compare with."""
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=100)
    ax.semilogx([full_bytes], [full_loss], "*", ms=12, color="black", label="all-reduce DP")
    for i, r in enumerate(rows):
        ax.semilogx(r["bytes"], r["loss"], "o", color=f"C{i}", label=r["name"])
        ax.annotate(f"{full_bytes / r['bytes']:.3g}x less", (r["bytes"], r["loss"]), textcoords="offset points",
                    xytext=(6, 3), fontsize=7)
    ax.set_xlim(min(r["bytes"] for r in rows) / 2, full_bytes * 3)
    ax.set_xlabel("bytes each worker sends per step (log)")
    ax.set_ylabel("loss on all digits at the end")
    ax.set_title("compression: bytes saved against loss reached", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def comparison(rows: list[dict], projected: dict, n_big: int, link_name: str):
    """One row per scheme, three panels sharing it: bytes a worker sends per step (with the loss reached), step
    time measured on the fast and the slow link, and the step time projected to n_big workers on the slow link."""
    names = [r["scheme"] for r in rows][::-1]
    by = {r["scheme"]: r for r in rows}
    y = range(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(12, 0.42 * len(names) + 1.6), dpi=100, sharey=True)
    a, b, c = axes
    a.barh(y, [by[n]["sent_per_worker_B"] / 1e3 for n in names], color="C0")
    a.set_xscale("log")
    for i, n in enumerate(names):
        a.text(by[n]["sent_per_worker_B"] / 1e3 * 1.15, i, f"loss {by[n]['final_loss']:.2f}, "
               f"{by[n]['accuracy']:.0%}", va="center", fontsize=7)
    a.set_xlim(1, max(by[n]["sent_per_worker_B"] for n in names) / 1e3 * 30)
    a.set_xlabel("kB each worker sends per step (log)")
    a.set_title(f"what it sends, and the loss after {rows[0]['loss_steps']:.0f} steps", fontsize=9)
    b.barh([i + 0.2 for i in y], [by[n]["step_ms_fast"] for n in names], 0.4, color="C2", label="10 Gb/s")
    b.barh([i - 0.2 for i in y], [by[n]["step_ms_slow"] for n in names], 0.4, color="C3", label="100 Mb/s")
    b.set_xscale("log")
    b.set_xlim(1, 2 * max(max(by[n]["step_ms_fast"], by[n]["step_ms_slow"]) for n in names))
    b.xaxis.set_minor_formatter(NullFormatter())
    b.set_xlabel("ms per step, virtual clock (log)")
    b.set_title("step time on an emulated fast and slow link", fontsize=9)
    b.legend(fontsize=7, loc="lower right")
    c.barh(y, [projected[n] * 1e3 for n in names], color="C5")
    c.set_xscale("log")
    c.set_xlim(1, 2e3 * max(projected.values()))
    c.set_xlabel("ms per step, cost model (log)")
    c.set_title(f"projected to {n_big} workers on {link_name}", fontsize=9)
    a.set_yticks(list(y))
    a.set_yticklabels(names, fontsize=8)
    fig.tight_layout()
    return fig
