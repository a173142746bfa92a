"""Measure step time against workers for PS and ring over one emulated link, next to the projection (notebook 10).

    python -m course_lib.bench.scaling --link "100 MbE" --workers 1 2 4

Each point is a real run on this machine: PS = 1 server + n workers (sync), ring = n ranks with one bucket of the
whole model all-reduced by the course ring (point-to-point, so the link emulation applies to both). The
projection adds the cost model's time on the link (projection.py; the PS push then pull, as ps_train's server works)
to the same run without emulation (compute and this machine's own localhost messages); the error column is
(measured - projected) / measured.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from .. import run
from ..costs.projection import ps_step, ring_step
from ..measure.netem import link as get_link
from ..training.allreduce import dp_train
from ..training.ps import ps_train


def _one_thread(train, **kwargs):
    """Run a trainer with one intra-op thread: a lone rank would otherwise use every core, and OpenMP threads
    that spin on a shared, loaded machine make its compute time swing by 10x (measured: 35-150 ms vs 3 ms)."""
    torch.set_num_threads(1)
    return train(**kwargs)


def _median_step(arch: str, n: int, steps: int, hidden: int, lnk, timeout: float = 60) -> tuple[float, int]:
    kw = dict(steps=steps, hidden=hidden, link=lnk)
    if arch == "ps":
        res = run(_one_thread, world_size=n + 1, args=(ps_train,), kwargs=kw, output="none", timeout=timeout)
        workers = res.values[1:]
    else:
        kw.update(method="bucket", collective="ring", bucket_bytes=1 << 30)
        res = run(_one_thread, world_size=n, args=(dp_train,), kwargs=kw, output="none", timeout=timeout)
        workers = res.values
    # the first step pays warm-up; the step time of a synchronous run is its slowest worker's
    return max(statistics.median(w["step_s"][1:]) for w in workers), res.values[0]["model_bytes"]


def measure(link_name: str = "100 MbE", workers=(1, 2, 4), steps: int = 10, hidden: int = 256,
            repeats: int = 2) -> list[dict]:
    """Rows {arch, n, base_s, measured_s, projected_s, error} for each arch and worker count.

    base_s: the same run without emulation (compute + this machine's real localhost messages, with n ranks
    sharing the cores); projected = base_s + the cost model's time on the link, as the emulation adds its delay
    on top of the real transfer. So the error measures the link model, not this machine's load. Each figure is
    the fastest of `repeats` runs: on a shared machine a run is only ever slowed down by others, never sped up.
    """
    lnk = get_link(link_name)
    rows = []
    for arch in ("ps", "ring"):
        for n in workers:
            base, m = min(_median_step(arch, n, steps, hidden, None) for _ in range(repeats))
            measured, _ = min(_median_step(arch, n, steps, hidden, lnk) for _ in range(repeats))
            projected = ps_step(n, m, lnk, 1, base) if arch == "ps" else ring_step(n, m, lnk, base)
            rows.append({"arch": arch, "n": n, "model_bytes": m, "base_s": base, "measured_s": measured,
                         "projected_s": projected, "error": (measured - projected) / measured})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--link", default="100 MbE")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    rows = measure(a.link, a.workers, a.steps, a.hidden, a.repeats)
    print(f"link {a.link}; model {rows[0]['model_bytes']} bytes; median step of the slowest worker, "
          f"fastest of {a.repeats} runs")
    print(f"{'arch':5} {'n':>3} {'no-link ms':>11} {'measured ms':>12} {'projected ms':>13} {'error':>7}")
    for r in rows:
        print(f"{r['arch']:5} {r['n']:>3} {r['base_s'] * 1e3:11.1f} {r['measured_s'] * 1e3:12.1f} "
              f"{r['projected_s'] * 1e3:13.1f} {r['error']:+7.0%}")


if __name__ == "__main__":
    main()
