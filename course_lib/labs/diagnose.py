"""Failure diagnosis demos, each bounded by a timeout: an absent rank, a collective mismatch, a straggler (notebook 16).

    torchrun --nproc-per-node=2 -m course_lib.labs.diagnose absent      # monitored_barrier names the missing rank
    torchrun --nproc-per-node=2 -m course_lib.labs.diagnose mismatch    # DETAIL debug mode says what differs
    torchrun --nproc-per-node=2 -m course_lib.labs.diagnose straggler   # per-rank timings show who everyone waits for

Each demo catches the error it provokes and prints it, so it ends (exit 0) instead of hanging a notebook or a job.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .group import join, leave, say


def absent_rank(timeout_s: float = 3.0, absent: int | None = None) -> str:
    """One rank never reaches the barrier; dist.monitored_barrier on rank 0 names it after timeout_s."""
    rank, world = dist.get_rank(), dist.get_world_size()
    absent = world - 1 if absent is None else absent
    # monitored_barrier exists only on gloo, and a failed one leaves a receive pending in its group: a gloo group on
    # the side carries it, so the default group (NCCL or gloo) stays usable. new_group is itself a collective, so
    # every rank makes it, the absent one included, before going missing.
    group = dist.new_group(backend="gloo")
    if rank == absent:
        time.sleep(timeout_s + 1.0)  # stuck elsewhere (a data loader, a deadlock, a slow disk): never arrives in time
        return f"rank {rank}: was elsewhere"
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        return f"rank {rank}: barrier passed"
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[0]
        say(f"rank {rank}: monitored_barrier: {msg}")
        return msg


def mismatch(dev: str | torch.device = "cpu") -> str:
    """Rank 0 all-reduces 4 elements, the others 3. Needs TORCH_DISTRIBUTED_DEBUG=DETAIL before the group is made."""
    rank = dist.get_rank()
    t = torch.ones(4 if rank == 0 else 3, device=dev)  # the bug: a shape that depends on the rank
    try:
        dist.all_reduce(t)
        return f"rank {rank}: no error (was TORCH_DISTRIBUTED_DEBUG=DETAIL set before init_process_group?)"
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[0]
        say(f"rank {rank}: {msg}")
        return msg


def straggler(steps: int = 4, slow: int | None = None, delay_s: float = 0.3, work_s: float = 0.02,
              dev: str | torch.device = "cpu") -> list:
    """Every rank computes then all-reduces; one rank computes delay_s longer. Returns (step, t0, t_compute, t_end)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    slow = world - 1 if slow is None else slow
    t = torch.ones(1000, device=dev)
    dist.barrier()
    origin, timeline = time.perf_counter(), []
    for step in range(steps):
        t0 = time.perf_counter() - origin
        time.sleep(work_s + (delay_s if rank == slow else 0.0))  # forward/backward; one GPU runs hot or throttles
        t1 = time.perf_counter() - origin
        dist.all_reduce(t)  # a collective starts only when the last rank arrives
        if torch.device(dev).type == "cuda":
            torch.cuda.synchronize(dev)  # NCCL returns at once; wait for the collective to be done
        timeline.append((step, t0, t1, time.perf_counter() - origin))
    return timeline


def name_straggler(timelines: list[list]) -> str:
    """From every rank's timeline: the rank that computed longest, and how long the others waited for it."""
    compute = [sum(t1 - t0 for _, t0, t1, _ in tl) for tl in timelines]
    wait = [sum(t2 - t1 for _, _, t1, t2 in tl) for tl in timelines]
    slow = max(range(len(compute)), key=compute.__getitem__)
    others = [r for r in range(len(compute)) if r != slow]
    return (f"straggler: rank {slow} computed {compute[slow]:.2f} s; the others waited "
            + ", ".join(f"rank {r} {wait[r]:.2f} s" for r in others) + " in all_reduce")


@record  # a failing rank's traceback reaches torchrun's final report
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m course_lib.labs.diagnose", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("demo", choices=["absent", "mismatch", "straggler"])
    ap.add_argument("--timeout", type=float, default=3.0, help="monitored_barrier timeout in seconds (absent)")
    args = ap.parse_args(argv)
    if args.demo == "mismatch":
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # read when the process group is made: set it first
        dist.set_debug_level_from_env()
    env, _, dev = join(timeout_s=max(10.0, 3 * args.timeout))
    try:
        if args.demo == "absent":
            absent_rank(args.timeout)
        elif args.demo == "mismatch":
            mismatch(dev)
        else:
            timelines = [None] * env.world_size
            dist.all_gather_object(timelines, straggler(dev=dev))
            if env.rank == 0:
                say(name_straggler(timelines))
    finally:
        leave()


if __name__ == "__main__":
    main()
