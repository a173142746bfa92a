"""Lab: the decentralized trainers of notebooks 11 and 11b under torchrun, the same code on one node or across nodes.

    torchrun --standalone --nproc-per-node=4 -m course_lib.labs.decentralized --arch gossip|localsgd|diloco|powersgd

--arch takes several names and runs each in turn in one job. Reads RANK, LOCAL_RANK and WORLD_SIZE from torchrun;
NCCL on cuda:LOCAL_RANK when there is a GPU per local rank, else gloo on CPU (labs/group.py). Every rank prints one
line per arch; rank 0 then says whether the final weights equal that arch's single-process reference: gossip,
decentralized SGD simulated with the mixing matrix (every rank's own row); localsgd and diloco, local_sgd.simulate;
powersgd, compression.simulate_powersgd. Equal means within what rounding alone allows (another node's kernels or a
GPU sum in other orders): gossip.averaged_sgd_atol for the SGD schemes, local_sgd.diloco_atol and
compression.powersgd_atol for DiLoCo and PowerSGD, whose float32 bounds say nothing (AdamW divides rounding by
eps = 1e-8; PowerSGD's QR and error feedback compound it): check those with --dtype float64 and a few --steps.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..training import gossip, local_sgd
from ..training.compression import compressed_train, powersgd_atol, simulate_powersgd
from ..training.model import flat_params, make_mlp
from ..training.tolerance import max_diff
from .group import join, leave, say

ARCHS = ("gossip", "localsgd", "diloco", "powersgd")


def _args(argv=None):
    p = argparse.ArgumentParser(prog="python -m course_lib.labs.decentralized", description=__doc__.split("\n")[0])
    p.add_argument("--arch", nargs="+", choices=ARCHS, required=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.1, help="SGD's (gossip, localsgd, powersgd)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--topology", default="ring", choices=gossip.TOPOLOGIES, help="gossip only")
    p.add_argument("--H", type=int, default=4, help="localsgd and diloco: steps between averages")
    p.add_argument("--rank-r", type=int, default=2, help="powersgd: rank of the approximation")
    p.add_argument("--link", default=None, help="emulate a link for point-to-point messages, e.g. '1 GbE'")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                   help="float64 makes the comparison decisive for diloco and powersgd")
    p.add_argument("--no-check", action="store_true", help="skip the single-process comparison on rank 0")
    a = p.parse_args(argv)
    a.dtype = getattr(torch, a.dtype)
    return a


def _run(arch: str, a) -> dict:
    common = dict(steps=a.steps, batch_size=a.batch_size, hidden=a.hidden, link=a.link)
    if arch == "gossip":
        return gossip.dpsgd_train(a.topology, lr=a.lr, measure_consensus=False, **common)   # float32 decides it
    if arch in ("localsgd", "diloco"):
        return local_sgd.local_sgd_train(H=a.H, lr=a.lr, outer="nesterov" if arch == "diloco" else None,
                                         dtype=a.dtype, **common)
    return compressed_train("powersgd", lr=a.lr, rank_r=a.rank_r, dtype=a.dtype, **common)


def _reference(arch: str, a, world: int) -> torch.Tensor:
    """What every rank must end with (gossip: one row per rank)."""
    common = dict(batch_size=a.batch_size, hidden=a.hidden)
    if arch == "gossip":
        return gossip.simulate(a.topology, world, a.steps, lr=a.lr, **common)
    if arch in ("localsgd", "diloco"):
        return local_sgd.simulate(world, a.H, a.steps, lr=a.lr, outer="nesterov" if arch == "diloco" else None,
                                  dtype=a.dtype, **common)
    return simulate_powersgd(world, a.steps, lr=a.lr, r=a.rank_r, dtype=a.dtype, **common)


def _tolerance(arch: str, a, world: int) -> float:
    """What rounding alone may change between the ranks and the single-process reference (see the docstring)."""
    if arch == "gossip":      # SGD steps, each followed by a mean of at most `world` models
        return gossip.averaged_sgd_atol(a.steps, a.lr, a.batch_size, a.hidden, world)
    if arch == "localsgd":
        return gossip.averaged_sgd_atol(a.steps, a.lr, a.batch_size, a.hidden, world, a.dtype)
    if arch == "diloco":
        return local_sgd.diloco_atol(world, a.H, a.steps, a.batch_size, a.hidden, a.dtype)
    return powersgd_atol(world, a.steps, a.batch_size, a.lr, a.hidden, r=a.rank_r, dtype=a.dtype)


@record
def main(argv=None) -> int:
    a = _args(argv)
    join()   # NCCL on cuda:LOCAL_RANK when the node has a GPU per worker, else gloo (labs/group.py)
    try:
        return max(_one(arch, a) for arch in a.arch)
    finally:
        leave()


def _one(arch: str, a) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = _run(arch, a)
    sent = statistics.mean(s for s, _ in out["traffic"])
    say(f"[rank {rank}/{world}] arch={arch} backend={dist.get_backend()} p2p bytes/step sent={sent:.0f} "
        f"loss {out['losses'][0]:.4f} -> {out['losses'][-1]:.4f} on its batches; final loss on all digits "
        f"{out['final_loss']:.4f}, median step {statistics.median(out['step_s']) * 1e3:.1f} ms")
    # every rank's final weights to rank 0 (on the rank's GPU under NCCL, which moves only device tensors)
    mine = out["params"].to(torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                            else torch.device("cpu"))
    params = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(params, mine)
    ok = True
    if rank == 0 and not a.no_check:
        ref = _reference(arch, a, world)
        rows = ref if ref.dim() == 2 else ref.expand(world, -1)
        diff = max(max_diff(p, r) for p, r in zip(params, rows))
        tol = _tolerance(arch, a, world)
        moved = max_diff(rows[0], flat_params(make_mlp(a.hidden)))     # how far training itself moved the weights
        ok = diff <= tol
        verdict = "EQUAL" if ok else "DIFFERENT"
        if tol >= moved:
            verdict += f"; rounding could move them as far as training did, so this cannot tell: run {arch} with " \
                       f"--dtype float64 and a few --steps"
        say(f"[rank 0] {arch}: every rank's final weights vs the single-process reference: max |diff| = {diff:.2e}, "
            f"rounding allows {tol:.1e} ({verdict})")
    dist.barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
