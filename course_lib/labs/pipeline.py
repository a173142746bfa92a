"""Lab: the pipeline schedules of notebook 14 under torchrun, one stage per process.

    torchrun --standalone --nproc-per-node=4 -m course_lib.labs.pipeline --schedule gpipe|1f1b [--microbatches 8]

Reads RANK, LOCAL_RANK and WORLD_SIZE from torchrun; NCCL on cuda:LOCAL_RANK when there is a GPU per local rank,
else gloo on CPU. Each rank holds one stage of the deep digits MLP and trains it with dist.recv/isend of activations
and gradients. Rank 0 prints the bubble against (p-1)/(m+p-1): the recorded order replayed on an ideal clock, the
wall clock of the timeline, and the order replayed with the run's measured hand-off costs; each stage's peak
activation bytes against in-flight x one micro-batch; whether the weights equal single-process SGD. The exit code is
0 only if the weights, the ideal-clock bubble and the bytes agree (the wall clock moves with the machine's load).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..training import pipeline as pl
from ..training.tolerance import max_diff, sgd_atol
from .group import join, leave, say


def _args(argv=None):
    p = argparse.ArgumentParser(prog="python -m course_lib.labs.pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--schedule", choices=sorted(pl.SCHEDULES), required=True)
    p.add_argument("--microbatches", type=int, default=8, help="m: micro-batches per step (must divide --batch)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--layers", type=int, default=8, help="Linears in the model, cut into one stage per process")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--stage-ms", type=float, default=10.0,
                   help="emulated compute per forward in ms (backward twice that); 0: only the real layers")
    return p.parse_args(argv)


@record
def main(argv=None) -> int:
    a = _args(argv)
    join()   # NCCL on cuda:LOCAL_RANK when the node has a GPU per worker, else gloo (labs/group.py)
    try:
        return _train(a)
    finally:
        leave()


def _train(a) -> int:
    rank, p, m = dist.get_rank(), dist.get_world_size(), a.microbatches
    out = pl.pipeline_train(a.schedule, steps=a.steps, m=m, batch=a.batch, lr=a.lr, layers=a.layers,
                            hidden=a.hidden, fwd_s=a.stage_ms / 1e3, record=True)
    say(f"[rank {rank}/{p}] stage {rank} schedule={a.schedule} backend={dist.get_backend()} "
        f"peak activations {out['peak_bytes']} B = {out['peak_bytes'] / max(out['microbatch_bytes'], 1):g} "
        f"micro-batches of {out['microbatch_bytes']} B")
    gathered = [None] * p
    dist.gather_object({k: out[k] for k in ("params", "events", "peak_bytes", "microbatch_bytes")},
                       gathered if rank == 0 else None, dst=0)
    ok = True
    if rank == 0:
        ok = _report(a, gathered)
    flag = torch.tensor([0 if ok else 1])
    dist.broadcast(flag, src=0)
    return int(flag.item())


def _report(a, gathered) -> bool:
    p, m = len(gathered), a.microbatches
    formula = pl.bubble_formula(p, m)
    measured = pl.measured_bubble([g["events"] for g in gathered])
    replayed = pl.simulated_bubble([[(k, i) for k, i, _, _ in pl.actions(g["events"])] for g in gathered])
    say(f"[rank 0] bubble (p-1)/(m+p-1) = {float(formula):.4f}; replayed from the recorded order: "
        f"{[f'{float(b):.4f}' for b in replayed]}; measured on the timeline: {[f'{b:.4f}' for b in measured]}")
    ok = all(b == formula for b in replayed)
    if a.stage_ms > 0:
        per_rank = [g["events"] for g in gathered]
        costs = pl.hand_off_costs(per_rank)
        replayed = pl.replayed_with_costs(per_rank, costs)
        wall = sum(measured) / p
        say(f"[rank 0] wall clock {wall:.4f} (formula {wall - float(formula):+.4f}); the recorded order replayed with "
            f"its measured action times, {costs['message'] * 1e3:.2f} ms per hand-off and {costs['between'] * 1e3:.2f}"
            f" ms between two actions of a stage: {sum(replayed) / p:.4f} (timings, not checked: they move with the "
            f"machine's load)")
    for s, g in enumerate(gathered):
        want = pl.in_flight_formula(a.schedule, s, p, m) * g["microbatch_bytes"]
        same = g["peak_bytes"] == want
        ok = ok and same
        say(f"[rank 0] stage {s}: peak activations {g['peak_bytes']} B, formula {want} B "
            f"({'EQUAL' if same else 'DIFFERENT'})")
    reference, _ = pl.train_reference(a.steps, a.batch, a.lr, a.layers, a.hidden)
    diff = max(max_diff(g["params"], w) for g, w in zip(gathered, pl.stage_params(reference, p)))
    tol = sgd_atol(a.steps, a.lr, a.batch, a.hidden)
    same = diff <= tol
    say(f"[rank 0] final weights vs single-process SGD: max |diff| = {diff:.2e} (bound {tol:.1e}: float32 sums in "
        f"another order) ({'EQUAL' if same else 'DIFFERENT'})")
    return ok and same


if __name__ == "__main__":
    raise SystemExit(main())
