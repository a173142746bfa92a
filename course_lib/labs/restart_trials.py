"""Repeat the elastic restart lab: how many of N runs with one SIGKILLed rank end with the right weights (notebook 16).

    python -m course_lib.labs.restart_trials --trials 10              # torchrun with a fresh store per restart
    python -m course_lib.labs.restart_trials --trials 10 --shared-store   # torchrun's default: shows the race
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from ..training.tolerance import max_diff
from . import torchrun as tr
from .elastic import reference, reference_atol
from .group import FRESH_STORE_ENV


def trial(workdir: Path, steps: int = 10, every: int = 4, kill_step: int = 6, shared_store: bool = False,
          timeout: float = 120.0) -> dict:
    """One killed run: did it finish, with the uninterrupted weights, after how many restarts, recovering how fast."""
    out = workdir / "w.pt"
    r = tr.run("course_lib.labs.elastic", ["--steps", steps, "--ckpt-every", every, "--ckpt-dir", workdir / "ck",
                                           "--out", out, "--kill-rank", 1, "--kill-step", kill_step],
               max_restarts=3, timeout=timeout, env={FRESH_STORE_ENV: "0"} if shared_store else None)
    row = {"ok": False, "seconds": round(r.seconds, 1), "returncode": r.returncode,
           "refused": r.output.count("Connection refused") > 0}
    if r.returncode == 0 and out.exists():
        rep, ref = torch.load(out), reference(steps, 2)
        tol = reference_atol(steps, 2)
        row.update(ok=all(max_diff(rep["weights"][k], ref[k]) <= tol for k in ref), restarts=rep["restart"],
                   recover_s=round(rep.get("recover_s", float("nan")), 2))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.labs.restart_trials", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--shared-store", action="store_true", help="torchrun's default shared store (the race)")
    ap.add_argument("--json", default=None, help="also write the rows and the summary here")
    args = ap.parse_args(argv)
    rows = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as d:
            rows.append(trial(Path(d), shared_store=args.shared_store))
        print(f"trial {i + 1}: {rows[-1]}", flush=True)
    ok = [r for r in rows if r["ok"]]
    rec = [r["recover_s"] for r in ok]
    summary = {"trials": len(rows), "succeeded": len(ok), "extra_restarts": sum(r["restarts"] - 1 for r in ok),
               "recover_s_median": statistics.median(rec) if rec else None,
               "recover_s_min": min(rec, default=None), "recover_s_max": max(rec, default=None),
               "store": "shared (torchrun default)" if args.shared_store else "fresh per restart"}
    print("summary " + json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
