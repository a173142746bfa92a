"""Hello across nodes: every rank says where it runs and checks one all-reduce against n(n+1)/2 (notebook 17).

    torchrun --nproc-per-node=2 -m course_lib.labs.hello
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        -m course_lib.labs.hello                                  # the same line on every node
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .group import join, leave, say


def hello(env, backend: str, dev: torch.device) -> str:
    """One all-reduce of rank+1 on every rank, checked against the formula; returns this rank's summary line."""
    t = torch.tensor([env.rank + 1.0], device=dev)
    dist.all_reduce(t)  # SUM of 1..world_size
    expected = env.world_size * (env.world_size + 1) / 2
    if t.item() != expected:
        raise RuntimeError(f"rank {env.rank}: all_reduce gave {t.item()}, expected {expected}")
    # Every rank learns every rank's node, so a rank can say whether the job really spans several nodes.
    nodes = [None] * env.world_size
    dist.all_gather_object(nodes, env.group_rank)
    return (f"rank {env.rank}/{env.world_size} local_rank {env.local_rank} node {env.group_rank} host {env.host} "
            f"backend {backend} device {dev} master {env.master_addr}:{env.master_port} "
            f"all_reduce {t.item():g} == {expected:g} ok; nodes of ranks {nodes}")


@record  # a failing rank's traceback reaches torchrun's final report, not only its own stderr
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m course_lib.labs.hello", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=60.0, help="process-group timeout in seconds (default 60)")
    args = ap.parse_args(argv)
    env, backend, dev = join(args.timeout)
    try:
        say(hello(env, backend, dev))
    finally:
        leave()


if __name__ == "__main__":
    main()
