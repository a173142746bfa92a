"""The %ranks / %%ranks IPython magic over a persistent group (notebooks/05b_collectives_cell_by_cell.ipynb).

Load it with ``%load_ext course_lib`` (or ``course_lib.runtime.ranks_magic``). This module owns the group the
magic started.
"""

from __future__ import annotations

import sys

from .cell_result import CellFailed, CellTimeout
from .persistent_ranks import Ranks

_current: Ranks | None = None


def current() -> Ranks | None:
    """The group that %ranks started (None before %ranks start)."""
    return _current


def _parse_ranks(text: str):
    words = text.replace(",", " ").split()
    if not words or words == ["all"]:
        return None
    try:
        return [int(w) for w in words]
    except ValueError:
        raise ValueError(f"%%ranks takes rank numbers like '0' or '0,2'; got {text!r}") from None


def ranks_magic(line: str, cell: str | None = None):
    """%ranks start [N] [--backend B] [--timeout S] [--check] [--nccl-rules] | stop | restart | pull NAME [ranks]
    | status;
    %%ranks [ranks] [--catch] [--timeout S] runs the cell on those ranks (default all), S seconds at most."""
    global _current
    if cell is not None:
        if _current is None or not _current.procs:
            raise RuntimeError("no ranks are running: start them first with %ranks start 4")
        words, limit = line.split(), None
        if "--timeout" in words:
            i = words.index("--timeout")
            try:
                limit = float(words[i + 1])
            except (IndexError, ValueError):
                raise ValueError(f"%%ranks --timeout takes seconds, like --timeout 30; got {line!r}") from None
            del words[i:i + 2]
        try:
            _current.run_cell(cell, _parse_ranks(" ".join(w for w in words if w != "--catch")), timeout=limit)
        except (CellFailed, CellTimeout) as err:
            if "--catch" not in words:  # --catch: show the failure without stopping "Run All" (for demos)
                raise
            print(err, file=sys.stderr)
        return None
    words = line.split()
    cmd, args = (words[0], words[1:]) if words else ("status", [])
    if cmd == "start":
        opts = {"--backend": "auto", "--timeout": "30"}
        n = int(args.pop(0)) if args and args[0].isdigit() else 4
        check, rules = "--check" in args, ("--nccl-rules" in args) or None
        args = [a for a in args if a not in ("--check", "--nccl-rules")]
        for key, value in zip(args[::2], args[1::2]):
            if key not in opts:
                raise ValueError(f"%ranks start knows --backend, --timeout, --check and --nccl-rules; got {key!r}")
            opts[key] = value
        if _current is not None:
            _current.stop()
        _current = Ranks(n, opts["--backend"], float(opts["--timeout"]), check, nccl_rules=rules).start()
        g = _current
        mode = " under NCCL rules" if g.nccl_rules else ""
        print(f"{n} ranks ready: backend {g.plan.backend}{mode}, devices {', '.join(g.plan.devices)}, "
              "collective timeout "
              f"{g.timeout:g} s (started in {g.start_s:.2f} s). In every rank: rank, world_size, device, torch, dist.")
        return None
    if _current is None:
        raise RuntimeError("no ranks are running: start them first with %ranks start 4")
    if cmd == "stop":
        _current.stop()
        print("ranks stopped; no rank process is left")
    elif cmd == "restart":
        _current.restart()
        print(f"{_current.world_size} new ranks ready (started in {_current.start_s:.2f} s); their namespaces "
              "are empty again: rerun the cells that define your variables")
    elif cmd == "pull":
        if not args:
            raise ValueError("%ranks pull needs a variable name, e.g. %ranks pull t")
        return _current.pull(args[0], _parse_ranks(" ".join(args[1:])))
    elif cmd == "status":
        return _current
    else:
        raise ValueError(f"unknown %ranks command {cmd!r}: use start, stop, restart, pull or status")
    return None


def load_ipython_extension(ipython) -> None:
    """%load_ext registers %ranks / %%ranks."""
    ipython.register_magic_function(ranks_magic, "line_cell", "ranks")
