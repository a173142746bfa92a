"""Command line: ``python -m course_lib doctor | bench launch``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    doc = sub.add_parser("doctor", help="what this machine can run, and a 2-rank smoke test")
    doc.add_argument("--ranks", type=int, default=2, help="ranks for the smoke test (default 2)")
    doc.add_argument("--backend", default="auto", help="auto, gloo, nccl or mpi (default auto)")

    bench = sub.add_parser("bench", help="benchmarks the course keeps")
    bsub = bench.add_subparsers(dest="what", required=True)
    bl = bsub.add_parser("launch", help="warm launch cost vs torch.multiprocessing.spawn")
    bl.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    bl.add_argument("--reps", type=int, default=20)
    bl.add_argument("--spawn-reps", type=int, default=3)
    bl.add_argument("--json", default=None, help="also write the figures to this file")

    args = parser.parse_args(argv)
    if args.cmd == "doctor":
        from .doctor import report

        return 0 if report(args.ranks, args.backend) else 1
    if args.cmd == "bench" and args.what == "launch":
        from .bench.launch import main as bench_launch

        bench_launch(tuple(args.ranks), args.reps, args.spawn_reps, args.json)
        return 0
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    sys.exit(main())
