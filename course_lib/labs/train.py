"""Lab: the same data-parallel trainers as notebooks 08-10, under torchrun.

    torchrun --standalone --nproc-per-node=4 -m course_lib.labs.train --arch ps|allreduce|ddp [--steps 20] ...

Reads RANK, LOCAL_RANK and WORLD_SIZE from torchrun; NCCL on the worker's own GPU when there is one per local rank,
else gloo on CPU; the asynchronous PS always gloo (its server receives from any worker, which NCCL cannot). Every
rank prints one summary line; the first worker prints whether the final weights equal single-process SGD on the
combined batch, to the float32 rounding bound (training/tolerance.py), as the synchronous architectures must.
"""

from __future__ import annotations

import argparse
import statistics

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..training import train_single
from ..training.allreduce import dp_train
from ..training.ps import ps_train
from ..training.tolerance import max_diff, sgd_atol
from .group import join, leave, say


def _args(argv=None):
    p = argparse.ArgumentParser(prog="python -m course_lib.labs.train", description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=["ps", "allreduce", "ddp"], required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--servers", type=int, default=1, help="ps: parameter-server ranks (the first ranks)")
    p.add_argument("--mode", choices=["sync", "async"], default="sync", help="ps only")
    p.add_argument("--collective", choices=["torch", "ring"], default="torch", help="allreduce only")
    p.add_argument("--link", default=None, help="emulate a link for point-to-point messages, e.g. '1 GbE'")
    p.add_argument("--no-check", action="store_true", help="skip the single-process comparison on rank 0")
    return p.parse_args(argv)


@record
def main(argv=None) -> int:
    a = _args(argv)
    # NCCL on the worker's own GPU when the node has one per worker, else gloo (labs/group.py); the asynchronous
    # server's dist.recv without a source is gloo-only, so that mode asks for gloo whatever the node has.
    join(backend="gloo" if a.arch == "ps" and a.mode == "async" else None)
    try:
        return _train(a)
    finally:
        leave()


def _train(a) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    common = dict(steps=a.steps, batch_size=a.batch_size, lr=a.lr, hidden=a.hidden, link=a.link)
    if a.arch == "ps":
        out = ps_train(n_servers=a.servers, mode=a.mode, **common)
        n_workers = world - a.servers
    else:
        out = dp_train(method="ddp" if a.arch == "ddp" else "bucket", bucket_bytes=1 << 30,
                       collective=a.collective if a.arch == "allreduce" else "torch", **common)
        n_workers = world
    sent = sum(s for s, _ in out["traffic"]) / max(1, len(out["traffic"]))
    recv = sum(r for _, r in out["traffic"]) / max(1, len(out["traffic"]))
    role = out.get("role", "worker")
    line = (f"[rank {rank}/{world}] arch={a.arch} role={role} backend={dist.get_backend()} "
            f"p2p bytes/step sent={sent:.0f} recv={recv:.0f}")
    if out.get("losses"):
        line += f" loss {out['losses'][0]:.4f} -> {out['losses'][-1]:.4f}"
        line += f" median step {statistics.median(out['step_s']) * 1e3:.1f} ms"
    say(line)
    ok = True
    if rank == (a.servers if a.arch == "ps" else 0) and not a.no_check and a.mode == "sync":
        ref, _ = train_single(n_workers, a.steps, a.batch_size, a.lr, a.hidden)
        diff = max_diff(out["params"], ref)
        # what float32 summation order can change: gradient sums over the combined batch and the hidden width
        tol = sgd_atol(a.steps, a.lr, n_workers * a.batch_size, a.hidden)
        ok = diff <= tol
        say(f"[rank {rank}] final weights vs single process on the combined batch: max |diff| = {diff:.2e}, "
            f"float32 rounding allows {tol:.1e} ({'EQUAL' if ok else 'DIFFERENT'})")
    dist.barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
