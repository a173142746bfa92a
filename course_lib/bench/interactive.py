"""Interactive ranks: cell round trip and group start, side by side with the one-shot launcher's cold and warm launch.

Run with ``python -m course_lib bench interactive``. Target: a trivial cell on 4 ranks (all_reduce of a small tensor
and a print) has a median round trip of at most 50 ms, so that a %%ranks cell feels like a local one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

CELL = "t = torch.ones(4)\ndist.all_reduce(t)\nprint(rank, t[0].item())"


def time_group_cold(world_size: int) -> float:
    """A fresh kernel's first group: starts the rank server (one torch import), then forks and joins the ranks."""
    from course_lib.runtime import forkserver as _forkserver
    from course_lib.runtime.persistent_ranks import Ranks

    _forkserver.shutdown()
    t0 = time.perf_counter()
    group = Ranks(world_size).start()
    took = time.perf_counter() - t0
    group.stop()
    return took


def time_group_start(world_size: int, reps: int) -> list[float]:
    """Warm starts: fork the ranks from the running server and wait until each has joined the process group."""
    from course_lib.runtime.persistent_ranks import Ranks

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        group = Ranks(world_size).start()
        times.append(time.perf_counter() - t0)
        group.stop()
    return times


def time_cells(world_size: int, reps: int, warmup: int = 5) -> list[float]:
    """Round trip of the trivial cell, as %%ranks runs it (send, exec on every rank, replies, output collected)."""
    from course_lib.runtime.persistent_ranks import Ranks

    with Ranks(world_size) as group:
        for _ in range(warmup):
            group.run_cell(CELL, show=False)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            res = group.run_cell(CELL, show=False)
            times.append(time.perf_counter() - t0)
            assert res.stdout == {r: f"{r} {float(world_size)}\n" for r in range(world_size)}, res.stdout
    return times


def _row(name: str, times: list[float]) -> str:
    q = statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0]
    return f"{name:<46}{statistics.median(times) * 1e3:>10.1f}{q * 1e3:>9.1f}{len(times):>6}"


def main(argv=None) -> int:
    """Measure and print the table; 0 when the round-trip target is met, 1 otherwise."""
    from course_lib.bench import launch

    ap = argparse.ArgumentParser(prog="python -m course_lib bench interactive", description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=50, help="cells timed (default 50)")
    ap.add_argument("--start-reps", type=int, default=10, help="group starts and warm launches timed (default 10)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    n = args.ranks
    out = {"ranks": n}
    out["launch_cold_s"] = launch.time_cold(n)  # first: it restarts the rank server
    out["group_cold_s"] = time_group_cold(n)
    out["launch_warm_s"], _ = launch.time_run(n, args.start_reps)
    out["group_start_s"] = time_group_start(n, args.start_reps)
    out["cell_s"] = time_cells(n, args.reps)
    print(f"{n} gloo ranks; times in ms{'':<20}{'median':>10}{'p90':>9}{'reps':>6}")
    print(_row("one-shot run(): cold (server start + launch)", [out["launch_cold_s"]]))
    print(_row("interactive group: cold (server start + start)", [out["group_cold_s"]]))
    print(_row("one-shot run(): warm launch (init+all_reduce)", out["launch_warm_s"]))
    print(_row("interactive group: warm start (fork + init)", out["group_start_s"]))
    print(_row("interactive cell: all_reduce + print", out["cell_s"]))
    cell = statistics.median(out["cell_s"])
    met = cell <= 0.050
    print(f"\nmedian cell round trip {cell * 1e3:.1f} ms (target <= 50 ms: {'met' if met else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
