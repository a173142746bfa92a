"""Plots of the memory wall, compute wall, speed formula and link speeds, from numbers handed in.

Taught in notebooks/01_why_distributed.ipynb and notebooks/02_cluster_architecture.ipynb; the numbers come
from course_lib.costs.hardware (data/ tables) and course_lib.bench.ceilings (this machine).
"""

from __future__ import annotations

import matplotlib.pyplot as plt

PART_COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52"}


def memory_bars(bars: dict, gpu_memory_GB: dict, title: str = "memory wall"):
    """Stacked bars in GB on a linear axis (parts keep their true proportions): bars = {label: {part: bytes}};
    a dashed vertical line per GPU memory size {label: GB}, named in the legend below the plot (never over a bar)."""
    labels = list(bars)
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(bars) + 2.1), dpi=100)
    biggest = max(sum(v for k, v in parts.items() if k != "total") for parts in bars.values()) / 1e9
    drawn = set()
    for i, lab in enumerate(labels):
        left = 0.0
        for part, nbytes in bars[lab].items():
            if part == "total":
                continue
            gb = nbytes / 1e9
            ax.barh(i, gb, left=left, height=0.6, color=PART_COLORS.get(part, "gray"),
                    label=part if part not in drawn else None)
            drawn.add(part)
            if gb > 0.09 * biggest:  # a part wide enough to carry its own number
                ax.text(left + gb / 2, i, f"{gb:,.0f}", ha="center", va="center", fontsize=7, color="white")
            left += gb
        ax.text(left, i, f" {left:,.0f} GB", va="center", fontsize=8)
    for (name, gb), style in zip(gpu_memory_GB.items(), ("--", "-.", ":", (0, (5, 1)))):
        ax.axvline(gb, color="black", ls=style, lw=1.2, label=f"{name}: {gb:g} GB")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, biggest * 1.2)
    ax.set_xlabel("GB (linear scale)")
    ax.set_title(title, fontsize=9)
    handles, names = ax.get_legend_handles_labels()
    legend_in = 0.2 * ((len(handles) + 2) // 3) + 0.1        # inches the legend rows need under the axes
    fig.legend(handles, names, fontsize=7, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 1))
    return fig


def gpu_hours_bars(rows: list[dict], title: str = "GPU-hours: published vs 6ND at one achieved FLOP/s"):
    """Pairs of bars per run: rows have name, published_gpu_hours, predicted_gpu_hours, error."""
    fig, ax = plt.subplots(figsize=(7, 3), dpi=100)
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["published_gpu_hours"] / 1e3 for r in rows], 0.4, label="published")
    ax.bar([i + 0.2 for i in x], [r["predicted_gpu_hours"] / 1e3 for r in rows], 0.4, label="6ND prediction")
    for i, r in zip(x, rows):
        note = "rate taken\nfrom this run" if r.get("used_to_fit") else f"{r['error']:+.0%}"
        ax.text(i + 0.2, r["predicted_gpu_hours"] / 1e3, note, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r["name"] for r in rows], fontsize=8)
    ax.set_ylabel("thousand GPU-hours")
    ax.set_ylim(0, max(max(r["published_gpu_hours"], r["predicted_gpu_hours"]) for r in rows) / 1e3 * 1.2)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def speed_plot(curve: list[dict], title: str = "speed = single-device speed x devices x speedup ratio"):
    """Speed (samples/s) against devices, with the ideal linear line, and the speedup ratio on a second panel."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3), dpi=100)
    ps = [c["devices"] for c in curve]
    a1.plot(ps, ps, "k--", label="ideal (ratio = 1)")
    a1.plot(ps, [c["speed"] / c["single_device_speed"] for c in curve], "o-", label="with ring all-reduce")
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("devices")
    a1.set_ylabel("speed (x one device)")
    a1.legend(fontsize=7)
    a2.plot(ps, [c["speedup_ratio"] for c in curve], "o-", color="#c44e52")
    a2.set_xscale("log", base=2)
    a2.set_ylim(0, 1.05)
    a2.set_xlabel("devices")
    a2.set_ylabel("multi-device speedup ratio")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def seconds_bars(items: dict, title: str, xlabel: str = "seconds (log scale)", highlight=()):
    """Horizontal bars on a log scale: items = {label: value}; labels in `highlight` drawn in red."""
    fig, ax = plt.subplots(figsize=(7, 0.28 * len(items) + 1.2), dpi=100)
    labels = list(items)
    ax.barh(range(len(labels)), [items[k] for k in labels],
            color=["#c44e52" if k in highlight else "#4c72b0" for k in labels])
    for i, k in enumerate(labels):
        ax.text(items[k], i, f" {items[k]:.3g}", va="center", fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def scaling_plot(curves: list[tuple], batch_limit: float | None = None,
                 title: str = "data parallelism: weak vs strong scaling"):
    """Speed-up over one device (left) and parallel efficiency (right) against devices, one line per
    (label, rows, color, linestyle) in curves; rows from costs.hardware.scaling (weak scaling: a fixed batch per
    device; strong: a fixed global batch), points where a device would get less than one sequence left out. The
    legend sits in the left panel's empty upper-left corner."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=100)
    ps = sorted({c["devices"] for _, rows, _, _ in curves for c in rows})
    a1.plot(ps, ps, "k:", lw=1, label="ideal: speed-up = devices")
    for label, rows, color, style in curves:
        ok = [c for c in rows if c.get("fits", True)]
        a1.plot([c["devices"] for c in ok], [c["speedup"] for c in ok], marker="o", ls=style, color=color, ms=3.5,
                label=label)
        a2.plot([c["devices"] for c in ok], [c["efficiency"] for c in ok], marker="o", ls=style, color=color, ms=3.5)
    ticks = [p for p in ps if p in (1, 4, 16, 64, 256, 1024, 4096)]
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(p) for p in ticks])
        ax.minorticks_off()
        ax.set_xlabel("devices")
        ax.grid(alpha=0.3, which="both")
        if batch_limit:
            ax.axvline(batch_limit, color="grey", ls=":", lw=1)
    if batch_limit:
        a2.text(batch_limit, 0.03, "one sequence\nper GPU ", fontsize=7, color="grey", va="bottom", ha="right")
    a1.set_yscale("log")
    a1.set_ylabel("speed-up over one device")
    a2.set_ylim(0, 1.05)
    a2.set_ylabel("efficiency = speed-up / devices")
    a1.legend(fontsize=7, loc="upper left", frameon=False, handlelength=3)   # above the diagonal: no data there
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def nic_rings(systems: list[dict], gpus_per_server: int = 8):
    """Two servers of gpus_per_server GPUs per panel, one panel per row of data/busbw_between_servers.csv
    (nics_per_server, busbw_GBps): the GPUs reach their server's NICs inside the server (thin lines), and each NIC
    has its own cable to the other server (thick lines); the panel's title gives the measured busbw."""
    fig, axes = plt.subplots(1, len(systems), figsize=(4.2 * len(systems), 2.8), dpi=100)
    for ax, s in zip(axes, systems):
        nics = int(s["nics_per_server"])
        ys = [gpus_per_server - 1 - i for i in range(gpus_per_server)]
        nic_ys = ys if nics == gpus_per_server else [sum(ys) / len(ys)] * nics
        for x0, gx, nx in ((0, 0.6, 2.0), (5.4, 7.4, 6.0)):            # left server, right server
            ax.add_patch(plt.Rectangle((x0 - 0.1, -0.7), 2.8, gpus_per_server + 0.4, fill=False, lw=1, ec="grey"))
            for i, y in enumerate(ys):
                ax.add_patch(plt.Rectangle((gx - 0.35, y - 0.3), 0.7, 0.6, color="#4c72b0"))
                ny = nic_ys[i] if nics == gpus_per_server else nic_ys[0]
                ax.plot([gx, nx], [y, ny], color="grey", lw=0.6)
            for y in sorted(set(nic_ys)):
                ax.add_patch(plt.Rectangle((nx - 0.3, y - 0.25), 0.6, 0.5, color="#dd8452", zorder=3))
        for y in sorted(set(nic_ys)):
            ax.plot([2.3, 5.7], [y, y], color="#c44e52", lw=2.5)
        ax.text(0.6, gpus_per_server - 0.2, "GPUs", ha="center", fontsize=7)
        ax.text(2.0, gpus_per_server - 0.2, "NIC" if nics == 1 else "NICs", ha="center", fontsize=7)
        ax.text(4.0, -0.95, "network between servers", ha="center", va="center", fontsize=7, color="#c44e52")
        ax.set_title(f"{nics} NIC{'s' if nics > 1 else ''} per server: {s['busbw_GBps']:g} GB/s busbw "
                     "between servers", fontsize=9)
        ax.set_xlim(-0.4, 8.4)
        ax.set_ylim(-1.15, gpus_per_server + 0.1)
        ax.axis("off")
    fig.tight_layout()
    return fig


def what_each_gpu_holds(gpus: int = 4, layers: int = 4):
    """One row per way of splitting the model (the ZeRO paper's figure 1 in spirit): each of `gpus` GPUs drawn as a
    grid of the model's layers (rows) by the columns of their weight matrices, the part it stores coloured. ZeRO-3
    stores a slice like tensor parallelism but gathers each whole layer before computing with it (hatched)."""
    def holds(name, g, lay, col):                       # does GPU g store (layer lay, column slice col)?
        return {"data parallel": True, "tensor parallel": col == g, "pipeline parallel": lay == g,
                "ZeRO-3 / FSDP": col == g}[name]

    schemes = ("data parallel", "tensor parallel", "pipeline parallel", "ZeRO-3 / FSDP")
    fig, axes = plt.subplots(len(schemes), gpus, figsize=(1.3 * gpus + 1.6, 0.95 * len(schemes) + 0.4), dpi=100)
    for row, name in enumerate(schemes):
        for g in range(gpus):
            ax = axes[row][g]
            for lay in range(layers):
                for col in range(gpus):
                    held = holds(name, g, lay * gpus // layers, col)
                    ax.add_patch(plt.Rectangle((col, layers - 1 - lay), 0.92, 0.85, lw=0.5, ec="#4c72b0",
                                               fc="#4c72b0" if held else "white",
                                               hatch="////" if held and name.startswith("ZeRO") else None,
                                               alpha=0.45 if held and name.startswith("ZeRO") else 1))
            ax.set_xlim(-0.1, gpus)
            ax.set_ylim(-0.1, layers)
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(f"GPU {g}", fontsize=8)
            if g == 0:
                ax.set_ylabel(name, fontsize=7, rotation=0, ha="right", va="center")
    fig.suptitle("what each GPU stores: rows are layers, columns slices of their weight matrices", fontsize=9)
    fig.tight_layout()
    return fig
