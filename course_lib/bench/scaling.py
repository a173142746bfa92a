"""Measure step time against workers for PS and ring over one emulated link, next to the projection (notebook 10).

    python -m course_lib.bench.scaling --link "100 MbE" --workers 1 2 4 --compute-ms 0

Each point is a real run: PS = 1 server + n workers (sync), ring = n ranks with one bucket of the whole model
all-reduced by the course ring (point-to-point, so the link emulation applies to both). Times are read from the emulated
link's virtual clock with a fixed emulated compute per step, so they are the schedule's cost on the link, the same on
every machine. The projection is projection.py's formula for the same link and compute (the PS push then pull, as
ps_train's server works); the error column, (measured - projected) / measured, is where the formula and the schedule the
code really runs part.
"""

from __future__ import annotations

import argparse

from .. import run
from ..costs.projection import ps_step, ring_step
from ..measure.emulated_link import link as get_link
from ..training.allreduce import dp_train
from ..training.ps import ps_train


def _step(arch: str, n: int, steps: int, hidden: int, lnk, compute_s: float, timeout: float = 60) -> tuple[float, int]:
    kw = dict(steps=steps, hidden=hidden, link=lnk, compute_s=compute_s)
    if arch == "ps":
        res = run(ps_train, world_size=n + 1, kwargs=kw, output="none", timeout=timeout)
        workers = res.values[1:]
    else:
        kw.update(method="bucket", collective="ring", bucket_bytes=1 << 30)
        res = run(dp_train, world_size=n, kwargs=kw, output="none", timeout=timeout)
        workers = res.values
    # a synchronous step ends when its slowest worker's does; on the virtual clock every step takes the same time
    return max(w["step_s"][-1] for w in workers), res.values[0]["model_bytes"]


def measure(link_name: str = "100 MbE", workers=(1, 2, 4), steps: int = 3, hidden: int = 256,
            compute_s: float = 0.0, archs=("ps", "ring")) -> list[dict]:
    """Rows {arch, n, model_bytes, compute_s, measured_s, projected_s, error} for each arch and worker count
    (`archs`: "ps", "ring" or both; each point is a launch, so measure only what will be read)."""
    if not archs or set(archs) - {"ps", "ring"}:
        raise ValueError(f"archs must name 'ps', 'ring' or both, got {archs!r}")
    lnk = get_link(link_name)
    rows = []
    for arch in archs:
        for n in workers:
            measured, m = _step(arch, n, steps, hidden, lnk, compute_s)
            projected = ps_step(n, m, lnk, 1, compute_s) if arch == "ps" else ring_step(n, m, lnk, compute_s)
            rows.append({"arch": arch, "n": n, "model_bytes": m, "compute_s": compute_s, "measured_s": measured,
                         "projected_s": projected,
                         "error": (measured - projected) / measured if measured else 0.0})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--link", default="100 MbE")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--compute-ms", type=float, default=0.0, help="emulated compute per worker step")
    a = p.parse_args(argv)
    rows = measure(a.link, a.workers, a.steps, a.hidden, a.compute_ms / 1e3)
    print(f"link {a.link}; model {rows[0]['model_bytes']} bytes; {a.compute_ms:g} ms of emulated compute per step; "
          "step of the slowest worker on the virtual clock")
    print(f"{'arch':5} {'n':>3} {'measured ms':>12} {'projected ms':>13} {'error':>7}")
    for r in rows:
        print(f"{r['arch']:5} {r['n']:>3} {r['measured_s'] * 1e3:12.1f} {r['projected_s'] * 1e3:13.1f} "
              f"{r['error']:+7.0%}")


if __name__ == "__main__":
    main()
