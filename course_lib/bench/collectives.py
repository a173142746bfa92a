"""nccl-tests-style sweep of torch's collectives and the course's own algorithms (notebooks/07_measuring_communication).

Definitions from NVIDIA nccl-tests doc/PERFORMANCE.md: algbw = S / t; busbw = algbw x factor (all_reduce
2(n-1)/n; reduce_scatter, all_gather and alltoall (n-1)/n with S the whole array; broadcast, reduce, sendrecv 1),
t = the slowest rank's mean time per iteration. Same command under the course launcher and under torchrun:

    python -m course_lib.bench.collectives --ranks 4 --max-bytes 64M          # course launcher (run())
    torchrun --standalone --nproc-per-node=4 -m course_lib.bench.collectives  # torchrun, any number of nodes

Rank 0 prints the table, the machine's ceilings, the alpha-beta fit and the reduce+broadcast ratio, and writes the
CSV (--csv), a JSON summary (--json) and the plots (--plot).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# op -> busbw factor as a function of n ranks (nccl-tests doc/PERFORMANCE.md).
FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0,
    "alltoall": lambda n: (n - 1) / n, "sendrecv": lambda n: 1.0,
}
TORCH_OPS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "alltoall", "sendrecv",
             "reduce+broadcast"]
COURSE_OPS = ["ring", "tree", "recursive_doubling", "star"]   # course all-reduce algorithms (busbw: all_reduce's)
DEFAULT_OPS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "alltoall", "sendrecv",
               "reduce+broadcast", "ring"]


def parse_size(text: str) -> int:
    """'4K', '64M', '1G' or a number of bytes -> bytes (powers of 1024, as nccl-tests)."""
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def sizes_between(lo: int, hi: int, factor: int = 2) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def _make_op(name: str, nbytes: int, dtype, dev):
    """(callable doing one iteration, S in bytes) for op `name` with S = nbytes, on this rank."""
    import torch
    import torch.distributed as dist

    from course_lib import collectives as cc

    rank, p = dist.get_rank(), dist.get_world_size()
    es = torch.tensor([], dtype=dtype).element_size()
    count = max(1, nbytes // es)
    if name in ("reduce_scatter", "all_gather", "alltoall"):
        count = max(p, count // p * p)          # S is the whole array: p equal parts
    x = torch.ones(count, dtype=dtype, device=dev)
    if name == "all_reduce":
        return (lambda: dist.all_reduce(x)), count
    if name == "reduce_scatter":
        out = torch.empty(count // p, dtype=dtype, device=dev)
        return (lambda: dist.reduce_scatter_single(out, x)), count
    if name == "all_gather":
        part = torch.ones(count // p, dtype=dtype, device=dev)
        return (lambda: dist.all_gather_single(x, part)), count
    if name == "broadcast":
        return (lambda: dist.broadcast(x, 0)), count
    if name == "reduce":
        return (lambda: dist.reduce(x, 0)), count
    if name == "alltoall":
        out = torch.empty_like(x)
        return (lambda: dist.all_to_all_single(out, x)), count
    if name == "sendrecv":                      # every rank sends to rank+1 and receives from rank-1 at once
        buf = torch.empty_like(x)
        return (lambda: cc.exchange(x, (rank + 1) % p, buf, (rank - 1) % p)), count
    if name == "reduce+broadcast":
        return (lambda: (dist.reduce(x, 0), dist.broadcast(x, 0))), count
    if name in cc.ALL_REDUCE:
        algo = cc.ALL_REDUCE[name]
        return (lambda: algo(x)), count
    raise ValueError(f"unknown op {name!r}; choose from {TORCH_OPS + COURSE_OPS}")


def sweep(ops: list[str], sizes: list[int], dtype_name: str = "float32", warmup: int = 3, iters: int = 50,
          seconds_per_point: float = 1.0, progress: bool = True, blocks: int = 3) -> list[dict]:
    """Runs on every rank: time every op at every size; returns the rows (identical on all ranks).

    At each size the ops take turns, `blocks` rounds of timed iterations each, and an op's time is the median of
    its blocks (each block: the slowest rank's mean time per call). Taking turns means that load from other
    programs on a shared machine falls on all ops alike, so ratios measured side by side stay fair.
    """
    import statistics

    import torch
    import torch.distributed as dist

    from course_lib.devices import device

    dtype, dev = getattr(torch, dtype_name), device()
    rank, p = dist.get_rank(), dist.get_world_size()
    es = torch.tensor([], dtype=dtype).element_size()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows, t_start = [], time.perf_counter()
    for i, nbytes in enumerate(sizes):
        n_it, times, counts = {}, {op: [] for op in ops}, {}
        for block in range(blocks):
            for op in ops:
                fn, counts[op] = _make_op(op, nbytes, dtype, dev)
                fn()                                      # first call: connections, page faults
                sync()
                if block == 0:
                    # Every rank must run the same number of iterations: agree on them from the slowest warm-up.
                    t0 = time.perf_counter()
                    for _ in range(warmup):
                        fn()
                    sync()
                    est = _max_over_ranks((time.perf_counter() - t0) / max(warmup, 1), dev)
                    n_it[op] = max(2, min(iters, int(seconds_per_point / blocks / max(est, 1e-9))))
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(n_it[op]):
                    fn()
                sync()
                times[op].append(_max_over_ranks((time.perf_counter() - t0) / n_it[op], dev))
                del fn
        for op in ops:
            sec = statistics.median(times[op])
            size = counts[op] * es
            algbw = size / sec / 1e9
            factor = FACTORS["all_reduce" if op in COURSE_OPS or op == "reduce+broadcast" else op](p)
            rows.append({"op": op, "impl": "course" if op in COURSE_OPS else "torch", "backend": dist.get_backend(),
                         "ranks": p, "size_bytes": size, "count": counts[op], "dtype": dtype_name,
                         "time_us": sec * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
                         "iters": n_it[op] * blocks})
        if progress and rank == 0:
            _progress(i + 1, len(sizes), human(nbytes), time.perf_counter() - t_start)
    order = {op: k for k, op in enumerate(ops)}
    return sorted(rows, key=lambda r: (order[r["op"]], r["size_bytes"]))


def _max_over_ranks(value: float, dev) -> float:
    """The largest value over all ranks (nccl-tests reports the slowest rank's time)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _progress(done: int, total: int, what: str, elapsed: float) -> None:
    """A plain-text progress bar on stderr; one line per point when stderr is not a terminal (notebook, CI log)."""
    width, frac = 30, done / total
    eta = elapsed / done * (total - done)
    line = f"[{'#' * int(width * frac):<{width}}] {done}/{total} {what:<24} eta {eta:5.0f} s"
    end = "\r" if sys.stderr.isatty() and done < total else "\n"
    print(line, end=end, file=sys.stderr, flush=True)


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


def write_csv(rows: list[dict], path: str, ceilings: dict | None = None) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["source"])
        w.writeheader()
        note = "measured by python -m course_lib.bench.collectives on this machine"
        if ceilings:
            note += f" (memcpy {ceilings.get('memcpy_GBps', 0):.2f} GB/s, loopback TCP "
            note += f"{ceilings.get('loopback_tcp_GBps', 0):.2f} GB/s, one direction)"
        for r in rows:
            w.writerow({**r, "source": note})


def analyse(rows: list[dict]) -> dict:
    """Alpha-beta fit of torch's all_reduce, the course ring vs torch, and reduce+broadcast vs all_reduce."""
    from course_lib import costmodel as cm

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
        out["reduce_bcast_over_allreduce"] = {"size": human(s), "measured": by[("reduce+broadcast", s)]["time_us"]
                                              / by[("all_reduce", s)]["time_us"], **predicted_ratios(p)}
    return out


def predicted_ratios(p: int) -> dict:
    """Time of reduce + broadcast over all_reduce for large n, under three readings of the cost model.

    gloo (read from gloo/reduce.cc, broadcast.cc, allreduce.cc): reduce = ring reduce-scatter then the root
    gathers the p-1 reduced chunks ((p-1)/p n in at the root); broadcast = binomial tree (lg p rounds of n);
    all_reduce = ring (2(p-1)/p n). 'shared_cpu': one host, every byte copied by the same cores, so time ~ total
    bytes all ranks send: reduce (p-1) n + (p-1)/p n, broadcast (p-1) n, all_reduce 2 (p-1) n.
    """
    from course_lib import costmodel as cm

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
        lines.append(f"# reduce+broadcast / all_reduce time at {rb['size']}: measured {rb['measured']:.2f}x; "
                     f"predicted: bandwidth-optimal {rb.get('bandwidth_optimal_2x', 0):.2f}x, binomial trees "
                     f"{rb.get('binomial_trees', 0):.2f}x, gloo's algorithms {rb.get('gloo_algorithms', 0):.2f}x, "
                     f"shared-CPU total bytes {rb.get('shared_cpu_total_bytes', 0):.2f}x")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m course_lib bench collectives", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4, help="ranks to start with the course launcher (ignored "
                    "under torchrun, which sets WORLD_SIZE)")
    ap.add_argument("--ops", nargs="+", default=DEFAULT_OPS, help=f"from {TORCH_OPS + COURSE_OPS}")
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--factor", type=int, default=2, help="size step (x2 by default, as nccl-tests -f 2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50, help="at most this many timed iterations per block")
    ap.add_argument("--blocks", type=int, default=3, help="rounds in which the ops take turns; median is kept")
    ap.add_argument("--seconds-per-point", type=float, default=1.0, help="fewer iterations when slower than this")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--ceiling-seconds", type=float, default=0.5, help="0 skips the memcpy/TCP ceilings")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG: busbw vs size with the ceilings, and the alpha-beta fit")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _torchrun_rank(args) -> list[dict]:
    """Under torchrun: this process is one rank; initialise from env:// (NCCL when there is a GPU per rank)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = args.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    try:
        return sweep(args.ops, _sizes(args), args.dtype, args.warmup, args.iters, args.seconds_per_point,
                     not args.no_progress, args.blocks)
    finally:
        dist.destroy_process_group()


def _sizes(args) -> list[int]:
    return sizes_between(parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    bad = [o for o in args.ops if o not in TORCH_OPS + COURSE_OPS]
    if bad:
        print(f"unknown ops {bad}; choose from {TORCH_OPS + COURSE_OPS}", file=sys.stderr)
        return 2
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    lead = not under_torchrun or int(os.environ.get("RANK", "0")) == 0
    ceilings = None
    if lead and args.ceiling_seconds > 0:                # before the sweep, so they do not compete with it
        from course_lib.bench.ceilings import measure_ceilings

        ceilings = measure_ceilings(args.ceiling_seconds)
    if under_torchrun:
        rows = _torchrun_rank(args)
    else:
        from course_lib import run

        res = run(sweep, args.ranks, args=(args.ops, _sizes(args), args.dtype, args.warmup, args.iters,
                                           args.seconds_per_point, not args.no_progress, args.blocks),
                  backend=args.backend, timeout=args.timeout, output="live")
        rows = res.values[0]
    if not lead:
        return 0
    summary = analyse(rows)
    print(report(rows, ceilings, summary))
    if args.csv:
        write_csv(rows, args.csv, ceilings)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ceilings": ceilings, "summary": summary}, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        from course_lib.viz.bandwidth import plot_sweep

        plot_sweep(rows, ceilings, summary.get("fit")).savefig(args.plot, dpi=100, bbox_inches="tight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
