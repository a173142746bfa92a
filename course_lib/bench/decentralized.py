"""Notebook 11b's schemes side by side on 4 workers: loss reached, bytes per step, step time on a fast and a slow
emulated link, and one straggler (a worker 3x slower to compute).

    python -m course_lib.bench.decentralized --steps 192 --out data/decentralized_4workers.csv

Every scheme trains the course's MLP on the digits with the same seeds and shards (training/): the synchronous PS (1
server + 4 workers), all-reduce data parallel (local SGD with H = 1, equal to it), gossip on two topologies, local SGD
and DiLoCo with H = 16, PowerSGD rank 2 and top-k 1% with error feedback (and, for the loss only, PowerSGD rank 1 and 4,
top-k 10%, and DiLoCo's control: local SGD with its AdamW inner steps). All their messages are point-to-point (the
course's ring for all-reduce), so the emulated link times every one and traffic counts every byte. One launch per world
size runs every scheme's configurations one after the other: the loss run (no link), then the fast link, the slow link
and the straggler. The timings are read from the emulated link's virtual clock with a fixed emulated compute per step,
so they are the same on every machine.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import statistics

import torch
import torch.distributed as dist

from .. import device, run
from ..collectives import chunk_bounds
from ..costs.decentralized import MAIN, SCHEMES, sent_per_step
from ..measure.emulated_link import emulate, link
from ..measure.traffic import Meter, metered
from ..training import ps
from ..training.compression import compressed_train
from ..training.data import DATA_DIR
from ..training.gossip import dpsgd_train, evaluate, tau
from ..training.local_sgd import local_sgd_train
from ..training.model import flat_params, make_mlp
from ..training.straggler import Straggler

FAST, SLOW, FACTOR = "10 GbE", "100 MbE", 3.0
COMPUTE_S = 0.010    # every timing run: 10 ms of emulated compute per step (the straggler's 30 ms)


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
        return local_sgd_train(H=s.H, inner=s.inner or None, **kw)
    if s.kind == "diloco":
        return local_sgd_train(H=s.H, outer="nesterov", **kw)
    if s.kind == "gossip":
        return dpsgd_train(s.topology, measure_consensus=False, **kw)
    return compressed_train(s.kind, rank_r=s.r, k_fraction=s.k_fraction, **kw)


CONFIGS = ("fast", "slow", "straggler")


def _configs(loss_names, time_names, loss_steps: int, configs=CONFIGS) -> dict:
    """Run on every rank: the loss run of each scheme in loss_names, the timing runs of each in time_names."""
    torch.set_num_threads(1)     # ranks share the cores: one thread each keeps compute times steady
    last = dist.get_world_size() - 1
    # every timing run on the virtual clock with the same fixed compute; the straggler's is FACTOR times longer
    runs = {"fast": (link(FAST), (-1, 1.0, COMPUTE_S)), "slow": (link(SLOW), (-1, 1.0, COMPUTE_S)),
            "straggler": (link(FAST), (last, FACTOR, COMPUTE_S))}
    out = {n: {} for n in [*loss_names, *time_names]}
    for name in loss_names:
        out[name]["loss"] = _train(name, loss_steps)
    for name in time_names:
        for cfg in configs:
            out[name][cfg] = _train(name, _time_steps(name, dist.get_world_size()), *runs[cfg])
    return out


def _period(name: str, world: int) -> int:
    """Steps after which a scheme's schedule repeats: H for local SGD and DiLoCo, tau for the one-peer graph (its
    peer changes every step), else 1."""
    s = SCHEMES[name]
    if s.kind in ("local", "diloco"):
        return s.H
    if s.kind == "gossip" and s.topology == "one-peer exponential":
        return tau(world)
    return 1


def _skip(name: str, world: int) -> int:
    """Steps left out of a timing as warm-up: the first whole period."""
    return _period(name, world)


def _time_steps(name: str, world: int) -> int:
    """The warm-up and then whole periods, at least 7 steps of them. A window that cuts a period would take a
    rank's long steps without its short ones: with a straggler on the one-peer graph a rank's steps alternate
    (it waits for the straggler's delay every other step), and 7 steps of a period of 2 read 33 ms for a 30 ms pace."""
    p = _period(name, world)
    return p + p * math.ceil(7 / p)


def _per_step(v: dict, skip: int) -> float:
    """Mean seconds per step after the first `skip`."""
    xs = v["step_s"][skip:]
    return sum(xs) / len(xs)


def _row(name: str, workers: int, launches: list) -> dict:
    """One row of the comparison from every launch's results for scheme `name` (each a list over ranks)."""
    s = SCHEMES[name]
    world = workers + (1 if s.kind == "ps" else 0)
    skip = _skip(name, world)
    first = 1 if s.kind == "ps" else 0         # the PS server computes nothing: rows describe the workers
    row = {"scheme": name, "workers": workers}
    for res in (r for r in launches if "loss" in r[0]):
        wk = [v["loss"] for v in res[first:]]
        shapes = [tuple(q.shape) for q in make_mlp().parameters()]
        row.update(loss_steps=len(wk[0]["losses"]), final_loss=statistics.mean(w["final_loss"] for w in wk),
                   accuracy=statistics.mean(w["accuracy"] for w in wk),
                   sent_per_worker_B=statistics.mean(statistics.mean(t[0] for t in w["traffic"]) for w in wk),
                   formula_sent_per_worker_B=statistics.mean(sent_per_step(s, workers, shapes, rank)
                                                             for rank in range(first, world)),
                   busiest_rank_sent_B=max(statistics.mean(t[0] for t in v["loss"]["traffic"]) for v in res))
    timed = [r for r in launches if set(CONFIGS) & set(r[0])]
    if not timed:
        return row
    row["time_steps"] = _time_steps(name, world)
    for cfg in ("fast", "slow"):    # a synchronous step lasts as long as its slowest worker's
        if cfg in timed[0][0]:
            row[f"step_ms_{cfg}"] = 1e3 * min(max(_per_step(v[cfg], skip) for v in r[first:]) for r in timed)
            if cfg == "fast":       # compute measured on the fast link, where the link adds least
                row["compute_ms"] = 1e3 * statistics.mean(statistics.mean(v["fast"]["compute_s"][skip:])
                                                          for v in timed[0][first:])
    if "straggler" not in timed[0][0]:
        return row
    best = min(timed, key=lambda r: max(_per_step(v["straggler"], skip) for v in r[first:]))
    strag = [v["straggler"] for v in best[first:]]
    steps = [_per_step(v, skip) for v in strag]
    waits = [max(0.0, 1 - statistics.mean(v["compute_s"][skip:]) / st) for v, st in zip(strag, steps)]
    row.update(step_ms_straggler=1e3 * max(steps),
               wait_frac_fast_workers=statistics.mean(waits[:-1]), wait_frac_straggler=waits[-1])
    return row


def compare(names=MAIN, workers: int = 4, loss_steps: int = 192, timed=MAIN, configs=CONFIGS) -> list[dict]:
    """One row per scheme in `names`. Each world size (PS: workers + 1, the rest: workers) gets one launch that
    runs its schemes one after the other: the loss runs (loss_steps = 0: none), then the timing runs (`configs`, of
    the schemes in `timed`)."""
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(workers + (1 if SCHEMES[n].kind == "ps" else 0), []).append(n)
    launches: dict[str, list] = {n: [] for n in names}
    for world, group in groups.items():
        loss_names = group if loss_steps else []
        time_names = [n for n in group if n in timed]
        if not loss_names and not time_names:
            continue
        vals = run(_configs, world, args=(loss_names, time_names, loss_steps, configs), output="none",
                   timeout=900).values
        for n in {*loss_names, *time_names}:
            launches[n].append([v[n] for v in vals])
    return [_row(n, workers, launches[n]) for n in names]


TABLE = DATA_DIR / "decentralized_4workers.csv"


def load(path=TABLE) -> list[dict]:
    """The committed comparison (its `source` column says when, where and with which command it was measured);
    the schemes timed on no link have no timing columns."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: (v if k in ("scheme", "source") else float(v)) for k, v in row.items() if v != ""} for row in rows]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=192, help="steps of the loss run (a multiple of 16)")
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES),
                   help="which schemes (the timing runs are for those of notebook 11b's side by side)")
    p.add_argument("--out", default=None, help="write the rows to this CSV file")
    p.add_argument("--machine", default="this machine", help="the machine, stored in every row (for the losses)")
    a = p.parse_args(argv)
    rows = compare(a.schemes, a.workers, a.steps)
    print(f"{'scheme':22} {'loss':>6} {'acc':>6} {'B/step/worker':>13} {'formula':>9} {'busiest':>9} "
          f"{'fast ms':>8} {'slow ms':>8} {'strag ms':>8} {'wait fast':>9}")
    for r in rows:
        line = (f"{r['scheme']:22} {r['final_loss']:6.3f} {r['accuracy']:6.1%} {r['sent_per_worker_B']:13,.0f} "
                f"{r['formula_sent_per_worker_B']:9,.0f} {r['busiest_rank_sent_B']:9,.0f}")
        if "step_ms_fast" in r:
            line += (f" {r['step_ms_fast']:8.1f} {r['step_ms_slow']:8.1f} {r['step_ms_straggler']:8.1f} "
                     f"{r['wait_frac_fast_workers']:9.0%}")
        print(line)
    if a.out:
        command = f"python -m course_lib.bench.decentralized --steps {a.steps} --workers {a.workers}"
        source = (f"measured {datetime.date.today()} on {a.machine} with: {command}; fast link {FAST}, slow link "
                  f"{SLOW} (the emulated link, timed on its virtual clock); "
                  f"{COMPUTE_S * 1e3:g} ms of emulated compute per step; "
                  f"straggler: the last worker's compute {FACTOR * COMPUTE_S * 1e3:g} ms, on the fast link")
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*max(rows, key=len), "source"])
            w.writeheader()
            for r in rows:
                w.writerow({**{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()},
                            "source": source})


if __name__ == "__main__":
    main()
