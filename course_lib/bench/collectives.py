"""nccl-tests-style sweep of torch's collectives and the course's own algorithms (notebooks/07_measuring_communication).

Definitions from NVIDIA nccl-tests doc/PERFORMANCE.md: algbw = S / t; busbw = algbw x factor (all_reduce
2(n-1)/n; reduce_scatter, all_gather and alltoall (n-1)/n with S the whole array; broadcast, reduce, sendrecv 1).
t is one number per size although every rank measures its own time per iteration: nccl-tests averages the ranks by
default (its option -a 1; -a 0 rank 0, -a 2 the fastest, -a 3 the slowest). This course reports the slowest rank
(--average max, nccl-tests' -a 3) unless told otherwise: a collective is finished for the job only when its last
rank is, and with several ranks sharing a CPU their times differ by tens of percent, which an average would hide.
Same command under the course launcher and under torchrun:

    python -m course_lib.bench.collectives --ranks 4 --max-bytes 64M          # course launcher (run())
    torchrun --standalone --nproc-per-node=4 -m course_lib.bench.collectives  # torchrun, any number of nodes

Rank 0 prints the table, the machine's ceilings, the alpha-beta fit and the reduce+broadcast ratio, and writes the
CSV (--csv), a JSON summary (--json) and the plots (--plot).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from .sweep_report import (  # noqa: F401 (public here too)
    analyse,
    human,
    predicted_ratio,
    predicted_ratios,
    report,
    table,
    write_csv,
)

# op -> busbw factor as a function of n ranks (nccl-tests doc/PERFORMANCE.md).
FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0,
    "alltoall": lambda n: (n - 1) / n, "sendrecv": lambda n: 1.0,
}
TORCH_OPS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "alltoall", "sendrecv",
             "reduce+broadcast"]
COURSE_OPS = ["ring", "tree", "recursive_doubling", "rabenseifner", "star"]   # course all-reduces (all_reduce's busbw)
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


AVERAGES = {"max": 3, "mean": 1, "min": 2, "rank0": 0}   # --average name -> nccl-tests' -a number


def sweep(ops: list[str], sizes: list[int], dtype_name: str = "float32", warmup: int = 3, iters: int = 50,
          seconds_per_point: float = 1.0, progress: bool = True, blocks: int = 3, average: str = "max") -> list[dict]:
    """Runs on every rank: time every op at every size; returns the rows (identical on all ranks).

    At each size the ops take turns, `blocks` rounds of timed iterations each, and an op's time is the median of
    its blocks (each block: every rank's mean time per call, combined over ranks by `average`: "max" the slowest
    rank, "mean", "min" or "rank0", as nccl-tests' -a 3/1/2/0). Taking turns means that load from other programs on
    a shared machine falls on all ops alike, so ratios measured side by side stay fair.
    """
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {sorted(AVERAGES)}, got {average!r}")
    import statistics

    import torch
    import torch.distributed as dist

    from course_lib.runtime.devices import device

    dtype, dev = getattr(torch, dtype_name), device()
    rank, p = dist.get_rank(), dist.get_world_size()
    names = [None] * p
    dist.all_gather_object(names, socket.gethostname())    # one host or several decides what to predict
    hosts = len(set(names))
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
                    est = _over_ranks((time.perf_counter() - t0) / max(warmup, 1), dev, "max")   # the slowest rank's
                    n_it[op] = max(2, min(iters, int(seconds_per_point / blocks / max(est, 1e-9))))
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(n_it[op]):
                    fn()
                sync()
                times[op].append(_over_ranks((time.perf_counter() - t0) / n_it[op], dev, average))
                del fn
        for op in ops:
            sec = statistics.median(times[op])
            size = counts[op] * es
            algbw = size / sec / 1e9
            factor = FACTORS["all_reduce" if op in COURSE_OPS or op == "reduce+broadcast" else op](p)
            rows.append({"op": op, "impl": "course" if op in COURSE_OPS else "torch", "backend": dist.get_backend(),
                         "ranks": p, "size_bytes": size, "count": counts[op], "dtype": dtype_name,
                         "time_us": sec * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
                         "iters": n_it[op] * blocks, "time_over_ranks": average, "hosts": hosts})
        if progress and rank == 0:
            _progress(i + 1, len(sizes), human(nbytes), time.perf_counter() - t_start)
    order = {op: k for k, op in enumerate(ops)}
    return sorted(rows, key=lambda r: (order[r["op"]], r["size_bytes"]))


def _over_ranks(value: float, dev, how: str) -> float:
    """One number from every rank's value: max, mean, min or rank 0's (nccl-tests -a 3, 1, 2, 0)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=dev)
    if how == "rank0":
        dist.broadcast(t, 0)
    else:
        dist.all_reduce(t, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}[how])
        if how == "mean":
            t /= dist.get_world_size()
    return t.item()


def _progress(done: int, total: int, what: str, elapsed: float) -> None:
    """A plain-text progress bar on stderr; one line per point when stderr is not a terminal (notebook, CI log)."""
    width, frac = 30, done / total
    eta = elapsed / done * (total - done)
    line = f"[{'#' * int(width * frac):<{width}}] {done}/{total} {what:<24} eta {eta:5.0f} s"
    end = "\r" if sys.stderr.isatty() and done < total else "\n"
    print(line, end=end, file=sys.stderr, flush=True)


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
    ap.add_argument("--average", choices=sorted(AVERAGES), default="max",
                    help="how the ranks' times make one: max = the slowest rank (nccl-tests -a 3, the default here), "
                    "mean = nccl-tests' default -a 1, min = -a 2, rank0 = -a 0")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--ceiling-seconds", type=float, default=0.5, help="0 skips the memcpy/TCP ceilings")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG: busbw vs size with the ceilings, and the alpha-beta fit")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _join(backend: str) -> str:
    """Under torchrun: join env:// with the backend and GPU every lab uses (course_lib.labs.group.choose).

    NCCL only when this node has a GPU for each of its workers, and worker LOCAL_RANK on the node's own GPU of that
    number (runtime.devices.node_gpu), so two torchrun "nodes" sharing one machine never land on the same GPU.
    """
    import torch.distributed as dist

    from course_lib.labs.group import choose

    backend, dev = choose(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                          backend)
    dist.init_process_group(backend, device_id=dev if backend == "nccl" else None)
    return backend


def _torchrun_rank(args) -> list[dict]:
    """Under torchrun: this process is one rank of the sweep."""
    import torch.distributed as dist

    if not dist.is_initialized():
        _join(args.backend)
    try:
        return sweep(args.ops, _sizes(args), args.dtype, args.warmup, args.iters, args.seconds_per_point,
                     not args.no_progress, args.blocks, args.average)
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
                                           args.seconds_per_point, not args.no_progress, args.blocks, args.average),
                  backend=args.backend, timeout=args.timeout, output="live")
        rows = res.values[0]
    if not lead:
        return 0
    summary = analyse(rows)
    print(report(rows, ceilings, summary))
    if args.csv:
        launcher = "torchrun ... -m" if under_torchrun else "python -m"
        write_csv(rows, args.csv, ceilings, f"{launcher} course_lib.bench.collectives {' '.join(argv or sys.argv[1:])}")
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
