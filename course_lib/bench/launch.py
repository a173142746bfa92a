"""Launch cost: a warm course_lib.run of N ranks (init, one all_reduce, teardown) vs torch.multiprocessing.spawn,
how fast a large result comes back, 100 launches back to back, and what one rank of a small training job holds.

Run with ``python -m course_lib bench launch``. Targets: a warm 4-rank median of at most 0.25 s and at least 15x
faster than spawn measured in the same run; results returned at a speed of the order of a memory copy measured in
the same run; back-to-back launches leave no process and keep the kernel's memory flat. Both launchers do the same
work per rank.
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

    from course_lib.runtime.rank_setup import rss_bytes

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    assert allreduce_once() == world_size
    dist.destroy_process_group()
    with open(os.path.join(mem_dir, f"{rank}.json"), "w") as f:
        json.dump(rss_bytes(), f)


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
    from course_lib import run
    from course_lib.runtime import forkserver as _forkserver

    _forkserver.shutdown()
    t0 = time.perf_counter()
    run(allreduce_once, world_size, output="none")
    return time.perf_counter() - t0


def _filled(mb: int):
    import torch
    import torch.distributed as dist

    return torch.full((mb * 2**20 // 4,), float(dist.get_rank()))


def result_speed(mb: int, world_size: int = 2, reps: int = 3) -> dict:
    """MB/s at which ``world_size`` ranks each return an ``mb`` MB tensor, and a memory copy of the same size.

    The transfer time is the median launch's wall time minus the median of the same launch returning nothing and
    minus the slowest rank's time making its tensor: pickling, the pipe and rebuilding the tensors in the kernel.
    When that is within the spread of the empty launches, the result cost nothing measurable (MBps is None)."""
    import torch

    from course_lib import run

    empty = [run(_filled, world_size, args=(0,), output="none").wall_s for _ in range(reps)]
    full, making = [], []
    for _ in range(reps):
        res = run(_filled, world_size, args=(mb,), output="none", timeout=300)
        assert [v[-1].item() for v in res.values] == [float(r) for r in range(world_size)]
        full.append(res.wall_s)
        making.append(max(t["fn_s"] for t in res.times))
        del res
    src = torch.ones(mb * 2**20 // 4)
    t0 = time.perf_counter()
    src.clone()
    copy_s = time.perf_counter() - t0
    extra = statistics.median(full) - statistics.median(empty) - statistics.median(making)
    measurable = extra > max(empty) - min(empty)
    return {"mb_per_rank": mb, "ranks": world_size, "wall_s": statistics.median(full),
            "empty_launch_s": statistics.median(empty), "making_s": statistics.median(making),
            "MBps": world_size * mb / extra if measurable else None, "memcpy_MBps": mb / copy_s}


def _kernel_rss() -> int:
    from course_lib.runtime.rank_setup import rss_bytes

    return rss_bytes().get("rss", 0)


def _children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc; an empty list elsewhere)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(") ", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def back_to_back(n: int, world_size: int = 4) -> dict:
    """``n`` launches in a row: the kernel's RSS before and after, and rank processes left behind."""
    from course_lib import run
    from course_lib.runtime import forkserver as _forkserver

    run(allreduce_once, world_size, output="none")
    before = _kernel_rss()
    t0 = time.perf_counter()
    for _ in range(n):
        assert run(allreduce_once, world_size, output="none").values == [float(world_size)] * world_size
    took = time.perf_counter() - t0
    return {"launches": n, "seconds": took, "rss_start_MiB": before / 2**20, "rss_end_MiB": _kernel_rss() / 2**20,
            "left_running": len(_children_of(_forkserver.get_server().proc.pid))}


def _small_training() -> float:
    import torch
    import torch.distributed as dist  # noqa: F401  (the group is up: DDP uses it)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.runtime.rank_setup import rss_bytes

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
    opt = torch.optim.Adam(model.parameters())
    for _ in range(5):
        loss = model(torch.randn(16, 32)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return rss_bytes().get("private", 0) / 2**20


def _mib(mem: list[dict], key: str) -> str:
    vals = [m[key] for m in mem if key in m]
    return f"{statistics.median(vals) / 2**20:.0f}" if vals else "n/a"


def main(world_sizes=(2, 4, 8), reps: int = 20, spawn_reps: int = 3, json_path: str | None = None,
         result_mb=(1, 64, 512), launches: int = 100) -> dict:
    """Measure and print the launch tables; returns the figures."""
    from course_lib import run

    out = {"cold_4": time_cold(4), "run": {}, "spawn": {}}
    print(f"cold start (server + first 4-rank launch): {out['cold_4']:.2f} s")
    print(f"{'launcher':<22}{'ranks':>6}{'median s':>10}{'p90 s':>8}{'RSS MiB':>9}{'private MiB':>13}")
    for n in world_sizes:
        times, mem = time_run(n, reps)
        q = statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0]
        out["run"][n] = {"median": statistics.median(times), "p90": q, "memory": mem}
        print(f"{'course_lib.run (warm)':<22}{n:>6}{statistics.median(times):>10.3f}{q:>8.3f}"
              f"{_mib(mem, 'rss'):>9}{_mib(mem, 'private'):>13}", flush=True)
    ns = 4 if 4 in world_sizes else min(world_sizes)  # the baseline pays a torch import per rank: one size only
    times, mem = time_spawn(ns, spawn_reps)
    out["spawn"][ns] = {"median": statistics.median(times), "all": times, "memory": mem}
    print(f"{'mp.spawn':<22}{ns:>6}{statistics.median(times):>10.3f}{max(times):>8.3f}"
          f"{_mib(mem, 'rss'):>9}{_mib(mem, 'private'):>13}")
    warm4 = out["run"].get(4, {}).get("median")
    if warm4 and 4 in out["spawn"]:
        ratio = out["spawn"][4]["median"] / warm4
        out["ratio_spawn_over_run_4"] = ratio
        print(f"\nwarm 4-rank median {warm4:.3f} s (target <= 0.25 s: {'met' if warm4 <= 0.25 else 'NOT met'}); "
              f"spawn / run = {ratio:.1f}x (target >= 15x: {'met' if ratio >= 15 else 'NOT met'})")

    print(f"\n{'result per rank':<18}{'ranks':>6}{'launch s':>10}{'empty s':>9}{'making s':>10}{'MB/s':>9}"
          f"{'memcpy MB/s':>13}")
    out["results"] = []
    for mb in result_mb:
        row = result_speed(mb)
        out["results"].append(row)
        speed = f"{row['MBps']:.0f}" if row["MBps"] else "< noise"
        print(f"{f'{mb} MB':<18}{row['ranks']:>6}{row['wall_s']:>10.3f}{row['empty_launch_s']:>9.3f}"
              f"{row['making_s']:>10.3f}{speed:>9}{row['memcpy_MBps']:>13.0f}", flush=True)

    row = out["back_to_back"] = back_to_back(launches)
    print(f"\n{launches} launches of 4 ranks back to back: {row['seconds']:.1f} s, kernel RSS "
          f"{row['rss_start_MiB']:.0f} MiB -> {row['rss_end_MiB']:.0f} MiB, rank processes left running: "
          f"{row['left_running']}")
    private = run(_small_training, 2, output="none").values
    out["training_rank_private_MiB"] = max(private)
    print(f"private memory of a rank after 5 DDP + Adam steps of a small MLP: {max(private):.0f} MiB "
          "(course_lib.runtime.machine_limits.RANK_MEMORY_BYTES is sized on it)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out
