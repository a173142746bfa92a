"""Notebook 11's schemes side by side on 4 workers: loss reached, bytes per step, step time on a fast and a slow
emulated link, and one straggler (a worker 3x slower to compute).

    python -m course_lib.bench.decentralized --steps 192 --out data/decentralized_4workers.csv

Every scheme trains the course's MLP on the digits with the same seeds and shards (training/): the synchronous PS
(1 server + 4 workers), all-reduce data parallel (local SGD with H = 1, equal to it), gossip on two topologies, local
SGD and DiLoCo with H = 16, PowerSGD rank 2 and top-k 1% with error feedback. All their messages are point-to-point
(the course's ring for all-reduce), so netem delays every one and traffic counts every byte. One launch per scheme
runs all its configurations one after the other: the loss run (no link), the fast link, the slow link, the straggler.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import statistics

import torch
import torch.distributed as dist

from .. import device, run
from ..collectives import chunk_bounds
from ..measure.netem import emulate, link
from ..measure.traffic import Meter, metered
from ..training import ps
from ..training.compression import compressed_train
from ..training.decentralized_cost import SCHEMES, sent_per_step
from ..training.gossip import dpsgd_train, evaluate
from ..training.local_sgd import local_sgd_train
from ..training.model import flat_params, make_mlp
from ..training.straggler import Straggler

FAST, SLOW, FACTOR = "10 GbE", "100 MbE", 3.0
COMPUTE_S = 0.010    # straggler runs: every step's compute padded to 10 ms (the straggler's to 30 ms)


def _ps_train(steps, link=None, straggler=None, lr=0.1, batch_size=32, hidden=256, seed=0):
    """Synchronous PS with rank 0 serving, as ps.ps_train(n_servers=1), with a model the straggler hooks can see."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_mlp(hidden, seed).to(device())
    slow = Straggler(model, *(straggler or (-1, 1.0)))
    flat = flat_params(model)
    workers, meter = list(range(1, world)), Meter()
    with emulate(link), metered(meter):
        if rank == 0:
            ps._sync_server(flat.clone(), workers, steps, lr, meter)
            return {"role": "server", "traffic": meter.steps, "step_s": [], "compute_s": []}
        out = ps._worker(model, chunk_bounds(flat.numel(), 1), [0], steps, batch_size, seed, "sync", meter,
                         rank - 1, len(workers))
    final_loss, acc = evaluate(model)
    out.update(role="worker", traffic=meter.steps, compute_s=slow.compute_s, final_loss=final_loss, accuracy=acc)
    return out


def _train(name: str, steps: int, link=None, straggler=None) -> dict:
    """Run on every rank: scheme `name` of SCHEMES for `steps` steps."""
    s = SCHEMES[name]
    kw = dict(steps=steps, link=link, straggler=straggler)
    if s.kind == "ps":
        return _ps_train(**kw)
    if s.kind in ("allreduce", "local"):
        return local_sgd_train(H=s.H, **kw)
    if s.kind == "diloco":
        return local_sgd_train(H=s.H, outer="nesterov", **kw)
    if s.kind == "gossip":
        return dpsgd_train(s.topology, measure_consensus=False, **kw)
    return compressed_train(s.kind, rank_r=s.r, k_fraction=s.k_fraction, **kw)


def _configs(name: str, loss_steps: int, time_steps: int, straggler_rank: int) -> dict:
    """Run on every rank: the loss run (if loss_steps), then each timing run, in one launch."""
    torch.set_num_threads(1)     # ranks share the cores: one thread each keeps compute times steady
    out = {"loss": _train(name, loss_steps)} if loss_steps else {}
    out["fast"] = _train(name, time_steps, link(FAST))
    out["slow"] = _train(name, time_steps, link(SLOW))
    out["straggler"] = _train(name, time_steps, link(FAST), (straggler_rank, FACTOR, COMPUTE_S))
    return out


def _per_step(v: dict, skip: int) -> float:
    """Mean seconds per step after the first `skip` (warm-up; for H-step schemes one whole round)."""
    xs = v["step_s"][skip:]
    return sum(xs) / len(xs)


def measure(name: str, workers: int = 4, loss_steps: int = 192, time_steps: int = 0, repeats: int = 1) -> dict:
    """One row of the comparison for scheme `name` (a key of SCHEMES) on `workers` workers. loss_steps = 0 skips
    the loss run (no loss, accuracy or bytes columns); time_steps = 0: 8 steps, or two rounds of H steps. Each
    timing is the fastest of `repeats` launches: on a shared machine others only ever slow a run down."""
    s = SCHEMES[name]
    world = workers + (1 if s.kind == "ps" else 0)
    skip = s.H if s.kind in ("local", "diloco") else 1
    time_steps = time_steps or max(8, 2 * skip)
    if time_steps < 2 * skip:
        raise ValueError(f"{name}: time_steps must be at least {2 * skip} to time one whole round after warm-up")
    res = run(_configs, world, args=(name, loss_steps, time_steps, world - 1), output="none", timeout=600).values
    again = [run(_configs, world, args=(name, 0, time_steps, world - 1), output="none", timeout=600).values
             for _ in range(repeats - 1)]
    first = 1 if s.kind == "ps" else 0         # the PS server computes nothing: rows describe the workers
    row = {"scheme": name, "workers": workers}
    if loss_steps:
        wk = [v["loss"] for v in res[first:]]
        shapes = [tuple(q.shape) for q in make_mlp().parameters()]
        row.update(loss_steps=loss_steps, final_loss=statistics.mean(w["final_loss"] for w in wk),
                   accuracy=statistics.mean(w["accuracy"] for w in wk),
                   sent_per_worker_B=statistics.mean(statistics.mean(t[0] for t in w["traffic"]) for w in wk),
                   formula_sent_per_worker_B=statistics.mean(sent_per_step(s, workers, shapes, rank)
                                                             for rank in range(first, world)),
                   busiest_rank_sent_B=max(statistics.mean(t[0] for t in v["loss"]["traffic"]) for v in res))
    for cfg in ("fast", "slow"):    # a synchronous step lasts as long as its slowest worker's
        row[f"step_ms_{cfg}"] = 1e3 * min(max(_per_step(v[cfg], skip) for v in r[first:]) for r in [res, *again])
    best = min([res, *again], key=lambda r: max(_per_step(v["straggler"], skip) for v in r[first:]))
    strag = [v["straggler"] for v in best[first:]]
    steps = [_per_step(v, skip) for v in strag]
    waits = [max(0.0, 1 - statistics.mean(v["compute_s"][skip:]) / st) for v, st in zip(strag, steps)]
    row.update(time_steps=time_steps, step_ms_straggler=1e3 * max(steps),
               wait_frac_fast_workers=statistics.mean(waits[:-1]), wait_frac_straggler=waits[-1])
    return row


def compare(names=tuple(SCHEMES), workers: int = 4, loss_steps: int = 192, time_steps: int = 0,
            repeats: int = 1) -> list[dict]:
    """Rows for every scheme in `names`."""
    return [measure(n, workers, loss_steps, time_steps, repeats) for n in names]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=192, help="steps of the loss run (a multiple of 16)")
    p.add_argument("--time-steps", type=int, default=0, help="steps of each timing run (0: 8, or two rounds of H)")
    p.add_argument("--repeats", type=int, default=3, help="timing runs per scheme; the fastest counts")
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--out", default=None, help="write the rows to this CSV file")
    p.add_argument("--machine", default="this machine",
                   help="the machine and its load, stored in every row (cores, CPU, what else was running)")
    a = p.parse_args(argv)
    rows = compare(a.schemes, a.workers, a.steps, a.time_steps, a.repeats)
    print(f"{'scheme':22} {'loss':>6} {'acc':>6} {'B/step/worker':>13} {'formula':>9} {'busiest':>9} "
          f"{'fast ms':>8} {'slow ms':>8} {'strag ms':>8} {'wait fast':>9}")
    for r in rows:
        print(f"{r['scheme']:22} {r['final_loss']:6.3f} {r['accuracy']:6.1%} {r['sent_per_worker_B']:13,.0f} "
              f"{r['formula_sent_per_worker_B']:9,.0f} {r['busiest_rank_sent_B']:9,.0f} {r['step_ms_fast']:8.1f} "
              f"{r['step_ms_slow']:8.1f} {r['step_ms_straggler']:8.1f} {r['wait_frac_fast_workers']:9.0%}")
    if a.out:
        command = (f"python -m course_lib.bench.decentralized --steps {a.steps} --time-steps {a.time_steps} "
                   f"--workers {a.workers} --repeats {a.repeats}")
        source = (f"measured {datetime.date.today()} on {a.machine} with: {command}; fast link {FAST}, slow link "
                  f"{SLOW} (netem); straggler: the last worker, each worker's compute padded to "
                  f"{COMPUTE_S * 1e3:g} ms per step and the straggler's to {FACTOR * COMPUTE_S * 1e3:g} ms, on the "
                  f"fast link")
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*rows[0], "source"])
            w.writeheader()
            for r in rows:
                w.writerow({**{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()},
                            "source": source})


if __name__ == "__main__":
    main()
