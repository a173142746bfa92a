"""Reading a collectives sweep: the nccl-tests table, the CSV, and the analysis the course quotes (notebook 07).

Rows come from course_lib.bench.collectives.sweep. The analysis fits alpha and beta to torch's all_reduce with the
ring formula (gloo's all_reduce is a ring: gloo/allreduce.cc), compares the course's ring with it, and puts the
measured reduce + broadcast / all_reduce time ratio next to the one prediction that fits where the ranks ran.
"""

from __future__ import annotations

import math
import os
import platform


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(rows: list[dict]) -> str:
    """The rows as nccl-tests prints them: one block per op, size/count/type/time/algbw/busbw."""
    lines = []
    for op in dict.fromkeys(r["op"] for r in rows):
        rs = [r for r in rows if r["op"] == op]
        lines.append(f"# {op} ({rs[0]['impl']}, {rs[0]['backend']}, {rs[0]['ranks']} ranks)")
        lines.append(f"{'size':>12} {'count':>12} {'type':>8} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
        for r in rs:
            lines.append(f"{r['size_bytes']:>12} {r['count']:>12} {r['dtype']:>8} {r['time_us']:>11.1f} "
                         f"{r['algbw_GBps']:>12.3f} {r['busbw_GBps']:>12.3f}")
    return "\n".join(lines)


STATS = {"max": "the slowest rank's", "mean": "the ranks' average", "min": "the fastest rank's", "rank0": "rank 0's"}


def machine() -> str:
    """What the numbers were measured on: CPU model, cores, OS, torch (and GPU, where there is one)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = ""
    if torch.cuda.is_available():
        gpu = f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}, torch {torch.__version__}{gpu}"


def write_csv(rows: list[dict], path: str, ceilings: dict | None = None, command: str | None = None) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["source"])
        w.writeheader()
        note = f"measured on {machine()} with: {command or 'python -m course_lib.bench.collectives'}"
        stat = rows[0].get("time_over_ranks", "max")
        note += f"; time per call: {STATS.get(stat, stat)}, median of the blocks"
        if ceilings:
            note += f" (memcpy {ceilings.get('memcpy_GBps', 0):.2f} GB/s, loopback TCP "
            note += f"{ceilings.get('loopback_tcp_GBps', 0):.2f} GB/s, one direction)"
        for r in rows:
            w.writerow({**r, "source": note})


def analyse(rows: list[dict], one_host: bool | None = None) -> dict:
    """Alpha-beta fit of torch's all_reduce, the course ring vs torch, and reduce+broadcast vs all_reduce.

    one_host: the ranks shared one machine's cores and memory, which decides the prediction the reduce+broadcast
    ratio is compared with (predicted_ratio); by default read from the rows' `hosts` (1 when absent).
    """
    if one_host is None:
        one_host = rows[0].get("hosts", 1) == 1 if rows else True
    from course_lib.costs import alpha_beta as cm

    out: dict = {}
    ar = [r for r in rows if r["op"] == "all_reduce"]
    if len(ar) >= 2:
        p = ar[0]["ranks"]
        # gloo's allreduce is a ring (reduce-scatter + all-gather, gloo/allreduce.cc), so fit the ring's formula.
        alpha, beta = cm.fit_alpha_beta([r["size_bytes"] for r in ar], [r["time_us"] / 1e6 for r in ar], p, "ring")
        errs = [(cm.ring_allreduce(p, r["size_bytes"], alpha, beta) - r["time_us"] / 1e6) / (r["time_us"] / 1e6)
                for r in ar]
        out["fit"] = {"alpha_us": alpha * 1e6, "beta_GBps": (1 / beta / 1e9) if beta else math.inf,
                      "max_rel_err": max(abs(e) for e in errs), "rel_errs": errs,
                      "sizes": [r["size_bytes"] for r in ar], "ranks": p, "alpha": alpha, "beta": beta}
    by = {(r["op"], r["size_bytes"]): r for r in rows}
    ring = [(by[("ring", s)]["busbw_GBps"] / by[("all_reduce", s)]["busbw_GBps"], s)
            for (op, s) in by if op == "ring" and ("all_reduce", s) in by and s >= 16 << 20]
    if ring:
        out["ring_over_torch_busbw_16M_up"] = {human(s): v for v, s in sorted(ring, key=lambda x: x[1])}
    rb = [s for (op, s) in by if op == "reduce+broadcast" and ("all_reduce", s) in by]
    if rb:
        s = max(rb)
        p = by[("all_reduce", s)]["ranks"]
        model, predicted = predicted_ratio(p, one_host)
        out["reduce_bcast_over_allreduce"] = {"size": human(s), "measured": by[("reduce+broadcast", s)]["time_us"]
                                              / by[("all_reduce", s)]["time_us"], "predicted": predicted,
                                              "model": model}
    return out


def predicted_ratio(p: int, one_host: bool = True) -> tuple[str, float]:
    """The one prediction of reduce + broadcast time over all_reduce time (large n) that fits where the ranks run.

    On one host there are no links: every byte any rank sends over loopback TCP is copied by the same cores through
    the same memory, so time follows the total bytes all ranks move ("shared_cpu_total_bytes"). With a link and a
    CPU per rank, time follows the busiest link under the algorithms gloo runs ("gloo_algorithms").
    """
    name = "shared_cpu_total_bytes" if one_host else "gloo_algorithms"
    return name, predicted_ratios(p)[name]


def predicted_ratios(p: int) -> dict:
    """Time of reduce + broadcast over all_reduce for large n, under three readings of the cost model.

    gloo (read from gloo/reduce.cc, broadcast.cc, allreduce.cc): reduce = ring reduce-scatter then the root
    gathers the p-1 reduced chunks ((p-1)/p n in at the root); broadcast = binomial tree (lg p rounds of n);
    all_reduce = ring (2(p-1)/p n). 'shared_cpu': one host, every byte copied by the same cores, so time ~ total
    bytes all ranks send: reduce (p-1) n + (p-1)/p n, broadcast (p-1) n, all_reduce 2 (p-1) n.
    """
    from course_lib.costs import alpha_beta as cm

    if p < 2:
        return {}
    ring = 2 * (p - 1) / p
    gloo = ((p - 1) / p + (p - 1) / p + cm.lg(p)) / ring
    shared = ((p - 1) + (p - 1) / p + (p - 1)) / (2 * (p - 1))
    return {"bandwidth_optimal_2x": 2.0, "binomial_trees": cm.tree_over_ring_ratio(p), "gloo_algorithms": gloo,
            "shared_cpu_total_bytes": shared}


def report(rows: list[dict], ceilings: dict | None, summary: dict) -> str:
    lines = [table(rows)]
    if ceilings:
        lines.append("# ceilings of this machine (GB/s, one direction): " + ", ".join(
            f"{k.replace('_GBps', '')} {v:.2f}" for k, v in ceilings.items() if v is not None))
    f = summary.get("fit")
    if f:
        lines.append(f"# alpha-beta fit of all_reduce (ring model, p={f['ranks']}): alpha = {f['alpha_us']:.1f} us, "
                     f"1/beta = {f['beta_GBps']:.2f} GB/s; max |error| {100 * f['max_rel_err']:.0f}% over "
                     f"{human(min(f['sizes']))}-{human(max(f['sizes']))}")
    if "ring_over_torch_busbw_16M_up" in summary:
        lines.append("# course ring / torch all_reduce busbw: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in summary["ring_over_torch_busbw_16M_up"].items()))
    rb = summary.get("reduce_bcast_over_allreduce")
    if rb:
        lines.append(f"# reduce+broadcast / all_reduce time at {rb['size']}: measured {rb['measured']:.2f}x, "
                     f"predicted {rb['predicted']:.2f}x ({rb['model'].replace('_', ' ')})")
    return "\n".join(lines)
