"""Bandwidth plots of a measured sweep: busbw vs message size with the machine's ceilings, and the alpha-beta fit.

Taught in notebooks/07_measuring_communication.ipynb. Draws rows handed to it (course_lib.bench.collectives rows:
op, size_bytes, time_us, busbw_GBps, ...); never measures anything itself.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

_KiB, _MiB = 1 << 10, 1 << 20


def _size_axis(ax) -> None:
    ax.set_xscale("log", base=2)
    lo, hi = ax.get_xlim()
    ticks = [(t, name) for t, name in ((4 * _KiB, "4K"), (64 * _KiB, "64K"), (_MiB, "1M"), (16 * _MiB, "16M"),
                                       (256 * _MiB, "256M"), (4096 * _MiB, "4G"), (65536 * _MiB, "64G"))
             if lo <= t <= hi]
    ax.set_xticks([t for t, _ in ticks], [name for _, name in ticks])
    ax.set_xlabel("message size S (bytes)")


def plot_busbw(rows: list[dict], ceilings: dict | None = None, ax=None, ops=None, value: str = "busbw_GBps",
               published: list[dict] | None = None):
    """busbw (or algbw) vs size, one line per op; dashed lines for the ceilings (GB/s, one direction)."""
    ax = ax or plt.gca()
    ops = ops or list(dict.fromkeys(r["op"] for r in rows))
    for op in ops:
        rs = sorted((r for r in rows if r["op"] == op), key=lambda r: r["size_bytes"])
        if rs:
            style = "--" if rs[0].get("impl") == "course" else "-"
            ax.plot([r["size_bytes"] for r in rs], [r[value] for r in rs], style, marker=".", label=op)
    for key, color in (("memcpy_GBps", "grey"), ("loopback_tcp_GBps", "tab:red")):
        if ceilings and ceilings.get(key):
            ax.axhline(ceilings[key], color=color, ls=":", lw=1)
            ax.annotate(f"{key.replace('_GBps', '')} {ceilings[key]:.1f}", (0.01, ceilings[key]),
                        xycoords=("axes fraction", "data"), fontsize=7, color=color, va="bottom")
    for row in published or []:
        ax.scatter([row["size_bytes"]], [row["busbw_GBps"]], marker="*", s=60, color="k")
    _size_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel(f"{value.replace('_GBps', '')} (GB/s)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    return ax


def plot_fit(sizes, seconds, alpha: float, beta: float, model, ax=None, label: str = "all_reduce"):
    """Measured times (dots) and the fitted model t(S) = model(S, alpha, beta) (line), log-log, with the error."""
    ax = ax or plt.gca()
    ax.loglog(sizes, [s * 1e6 for s in seconds], "o", ms=4, label=f"{label}, measured")
    fine = [sizes[0] * (sizes[-1] / sizes[0]) ** (i / 99) for i in range(100)]
    ax.loglog(fine, [model(s, alpha, beta) * 1e6 for s in fine], "-",
              label=f"fit: alpha={alpha * 1e6:.0f} us, 1/beta={1 / beta / 1e9:.2f} GB/s" if beta else "fit")
    err = max(abs(model(s, alpha, beta) - t) / t for s, t in zip(sizes, seconds))
    ax.set_title(f"alpha-beta fit, max error {100 * err:.0f}%", fontsize=9)
    _size_axis(ax)
    ax.set_ylabel("time per call (us)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return ax


def plot_sweep(rows: list[dict], ceilings: dict | None = None, fit: dict | None = None):
    """The benchmark's figure: busbw of every op with the ceilings, and (given a fit) the all_reduce fit."""
    from course_lib.costs import alpha_beta as cm

    fig, axes = plt.subplots(1, 2 if fit else 1, figsize=(10 if fit else 5.5, 3.6), dpi=100, squeeze=False)
    plot_busbw(rows, ceilings, ax=axes[0][0])
    axes[0][0].set_title(f"busbw, {rows[0]['ranks']} ranks, {rows[0]['backend']}", fontsize=9)
    if fit:
        ar = sorted((r for r in rows if r["op"] == "all_reduce"), key=lambda r: r["size_bytes"])
        p = fit["ranks"]
        plot_fit([r["size_bytes"] for r in ar], [r["time_us"] / 1e6 for r in ar], fit["alpha"], fit["beta"],
                 lambda s, a, b: cm.ring_allreduce(p, s, a, b), ax=axes[0][1])
    fig.tight_layout()
    return fig


def plot_piecewise_fit(sizes, seconds, line: tuple[float, float], pieces: list[dict], title: str = "",
                       tol: float = 0.25, names=(), no_rate=(), split: str = ""):
    """Left: measured times, one t = a + b S line over all sizes (dashed) and one line per piece (solid), named by
    ``names``; pieces in ``no_rate`` (indices) get no 1/b in their label, their slope resting on too few points;
    ``split`` labels the dotted line where a piece starts. Right: each fit's relative error at every size, with the
    +-tol band. Pieces as costs.alpha_beta.fit_pieces."""
    from course_lib.costs import alpha_beta as cm

    a, b = line
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    left.loglog(sizes, [t * 1e6 for t in seconds], "o", ms=4, color="k", label="published")
    fine = [sizes[0] * (sizes[-1] / sizes[0]) ** (i / 199) for i in range(200)]
    left.loglog(fine, [(a + b * s) * 1e6 for s in fine], "--", color="grey",
                label=f"one line: {a * 1e6:.0f} us + S / {1 / b / 1e9:.0f} GB/s")
    for k, pc in enumerate(pieces):
        xs = [s for s in fine if pc["lo"] <= s <= pc["hi"]]
        name = f"piece {k + 1}" + (f" ({names[k]})" if k < len(names) else "")
        rate = "b S" if k in no_rate else f"S / {1 / pc['beta'] / 1e9:.0f} GB/s"
        left.loglog(xs, [(pc["alpha"] + pc["beta"] * s) * 1e6 for s in xs], "-", lw=2, color=f"C{k}",
                    label=f"{name}: {pc['alpha'] * 1e6:.0f} us + {rate}")
    for k, pc in enumerate(pieces[1:]):
        for ax in (left, right):    # the split named once, in the legend, where no curve can hide it
            ax.axvline(pc["lo"], color="k", lw=0.8, ls=":", label=f"split: {split}" if split and k == 0 and ax is left
                       else None)
    _size_axis(left)
    left.set_ylabel("time per call (us)")
    left.set_title(title or "a + b S fitted to a published sweep", fontsize=9)
    left.legend(fontsize=7, loc="upper left")
    left.grid(alpha=0.3, which="both")
    right.axhspan(-100 * tol, 100 * tol, color="tab:green", alpha=0.1, label=f"within {tol:.0%}")
    right.semilogx(sizes, [100 * (a + b * s - t) / t for s, t in zip(sizes, seconds)], "o--", ms=3, color="grey",
                   label="one line")
    right.semilogx(sizes, [100 * (cm.predict_pieces(pieces, s) - t) / t for s, t in zip(sizes, seconds)], "o-",
                   ms=3, color="C0", label=f"{len(pieces)} pieces")
    right.axhline(0, color="k", lw=0.6)
    _size_axis(right)
    right.set_ylabel("prediction error (%)")
    right.set_title("model minus measurement, relative", fontsize=9)
    right.legend(fontsize=7)
    right.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig
