"""Launch cost: a warm course_lib.run of N ranks (init, one all_reduce, teardown) vs torch.multiprocessing.spawn.

Run with ``python -m course_lib bench launch``. Targets (issue: foundation): warm 4-rank median <= 0.25 s and at
least 15x faster than spawn measured in the same run. Both sides do the same work per rank.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time


def allreduce_once() -> float:
    """The work each rank does in both launchers: one all_reduce of a one-element tensor."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _spawn_rank(rank: int, world_size: int, port: int, mem_dir: str) -> None:
    import torch.distributed as dist

    from course_lib._rank_main import _rss_bytes

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    assert allreduce_once() == world_size
    dist.destroy_process_group()
    with open(os.path.join(mem_dir, f"{rank}.json"), "w") as f:
        json.dump(_rss_bytes(), f)


def _free_port() -> int:
    # Baseline only: torch.multiprocessing.spawn's tcp:// init needs a port chosen up front.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_spawn(world_size: int, reps: int) -> tuple[list[float], list[dict]]:
    import torch.multiprocessing as mp

    times, mem = [], []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            mp.start_processes(_spawn_rank, args=(world_size, _free_port(), d), nprocs=world_size,
                               start_method="spawn")
            times.append(time.perf_counter() - t0)
            mem = [json.load(open(os.path.join(d, f))) for f in sorted(os.listdir(d))]
    return times, mem


def time_run(world_size: int, reps: int, warmup: int = 2) -> tuple[list[float], list[dict]]:
    from course_lib import run

    for _ in range(warmup):
        run(allreduce_once, world_size, output="none")
    times, res = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        res = run(allreduce_once, world_size, output="none")
        times.append(time.perf_counter() - t0)
        assert res.values == [float(world_size)] * world_size
    return times, res.memory


def time_cold(world_size: int = 4) -> float:
    """First launch in a fresh kernel: starts the rank server (one torch import) and then the ranks."""
    from course_lib import _forkserver, run

    _forkserver.shutdown()
    t0 = time.perf_counter()
    run(allreduce_once, world_size, output="none")
    return time.perf_counter() - t0


def _mib(mem: list[dict], key: str) -> str:
    vals = [m[key] for m in mem if key in m]
    return f"{statistics.median(vals) / 2**20:.0f}" if vals else "n/a"


def main(world_sizes=(2, 4, 8), reps: int = 20, spawn_reps: int = 3, json_path: str | None = None) -> dict:
    """Measure and print the launch table; returns the figures."""
    out = {"cold_4": time_cold(4), "run": {}, "spawn": {}}
    print(f"cold start (server + first 4-rank launch): {out['cold_4']:.2f} s")
    print(f"{'launcher':<22}{'ranks':>6}{'median s':>10}{'p90 s':>8}{'RSS MiB':>9}{'private MiB':>13}")
    for n in world_sizes:
        times, mem = time_run(n, reps)
        q = statistics.quantiles(times, n=10)[-1]
        out["run"][n] = {"median": statistics.median(times), "p90": q, "memory": mem}
        print(f"{'course_lib.run (warm)':<22}{n:>6}{statistics.median(times):>10.3f}{q:>8.3f}"
              f"{_mib(mem, 'rss'):>9}{_mib(mem, 'private'):>13}", flush=True)
    times, mem = time_spawn(4, spawn_reps)
    out["spawn"][4] = {"median": statistics.median(times), "all": times, "memory": mem}
    print(f"{'mp.spawn':<22}{4:>6}{statistics.median(times):>10.3f}{max(times):>8.3f}"
          f"{_mib(mem, 'rss'):>9}{_mib(mem, 'private'):>13}")
    warm4 = out["run"].get(4, {}).get("median")
    if warm4:
        ratio = out["spawn"][4]["median"] / warm4
        out["ratio_spawn_over_run_4"] = ratio
        print(f"\nwarm 4-rank median {warm4:.3f} s (target <= 0.25 s: {'met' if warm4 <= 0.25 else 'NOT met'}); "
              f"spawn / run = {ratio:.1f}x (target >= 15x: {'met' if ratio >= 15 else 'NOT met'})")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out
