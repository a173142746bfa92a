"""Command line: ``python -m course_lib doctor | bench ... | student | grade``."""

from __future__ import annotations

import argparse
import sys

# Commands whose module owns its own arguments: everything after the command words is handed over unchanged.
PASSTHROUGH = {
    ("bench", "collectives"): ("course_lib.bench.collectives", "nccl-tests-style sweep of collectives (algbw, busbw)"),
    ("bench", "interactive"): ("course_lib.bench.interactive", "persistent ranks: group start and cell round trip"),
    ("student",): ("course_lib.classroom.student", "build student copies of the notebooks (solutions removed)"),
    ("grade",): ("course_lib.classroom.grade", "grade submitted notebooks with the exercise checkers (CSV + summary)"),
    ("site",): ("course_lib.classroom.site", "the course as a static website in _site/ (Sphinx + myst-nb)"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    for words, (module, _) in PASSTHROUGH.items():
        if tuple(argv[: len(words)]) == words:
            import importlib

            return importlib.import_module(module).main(argv[len(words):])
    parser = argparse.ArgumentParser(prog="python -m course_lib", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    doc = sub.add_parser("doctor", help="what this machine can run, and a 2-rank smoke test")
    doc.add_argument("--ranks", type=int, default=2, help="ranks for the smoke test (default 2)")
    doc.add_argument("--backend", default="auto", help="auto, gloo, nccl or mpi (default auto)")

    bench = sub.add_parser("bench", help="benchmarks the course keeps")
    bsub = bench.add_subparsers(dest="what", required=True)
    bl = bsub.add_parser("launch", help="warm launch cost vs torch.multiprocessing.spawn, large results, 100 launches")
    bl.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    bl.add_argument("--reps", type=int, default=20)
    bl.add_argument("--spawn-reps", type=int, default=3)
    bl.add_argument("--result-mb", type=int, nargs="+", default=[1, 64, 512], help="MB each of 2 ranks returns")
    bl.add_argument("--launches", type=int, default=100, help="launches back to back for the memory check")
    bl.add_argument("--json", default=None, help="also write the figures to this file")
    bc = bsub.add_parser("ceilings", help="this machine's memcpy, loopback TCP and GPU copy bandwidth (one direction)")
    bc.add_argument("--seconds", type=float, default=1.0, help="time spent on each measurement")
    for words, (_, help_text) in PASSTHROUGH.items():
        (bsub if words[0] == "bench" else sub).add_parser(words[-1], help=help_text + " (--help for its options)")

    args = parser.parse_args(argv)
    if args.cmd == "doctor":
        from .classroom.doctor import report

        return 0 if report(args.ranks, args.backend) else 1
    if args.cmd == "bench" and args.what == "launch":
        from .bench.launch import main as bench_launch

        bench_launch(tuple(args.ranks), args.reps, args.spawn_reps, args.json, tuple(args.result_mb), args.launches)
        return 0
    if args.cmd == "bench" and args.what == "ceilings":
        from .bench.ceilings import main as ceilings

        ceilings(args.seconds)
        return 0
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    sys.exit(main())
