"""One persistent rank: join the process group once, then run cell after cell in a namespace kept between cells.

The child side of persistent ranks (persistent_ranks.py, notebooks/05b_collectives_cell_by_cell.ipynb).
Forked by the rank server (forkserver.py) with torch preloaded; it shares the one-shot rank's setup
(rank_setup.py) and speaks the request/reply protocol drawn in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import ast
import io
import linecache
import os
import signal
import socket
import sys
import time
import traceback

from . import transfer
from .protocol import EXIT_OK, EXIT_RAISED, recv_msg, send_msg
from .rank_setup import become_rank, failure_report, init_group, to_cpu

_THIS = os.path.basename(__file__)


def _ignore_sigint(*_):
    # Between cells a late interrupt (the kernel relays every stop press) must not break the message framing.
    pass


def _namespace(msg: dict) -> dict:
    import torch
    import torch.distributed as dist

    return {"__name__": "__main__", "__builtins__": __builtins__, "torch": torch, "dist": dist,
            "rank": msg["rank"], "world_size": msg["world_size"], "device": torch.device(msg["device"])}


def _compile(code: str, filename: str):
    """The cell as (body, last expression or None), the way IPython shows a cell's last value."""
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
    return compile(tree, filename, "exec"), last


def _figures() -> list[bytes]:
    """PNGs of the figures this cell left open (matplotlib runs headless here: MPLBACKEND=Agg)."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    pngs = []
    for num in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(num).savefig(buf, format="png", dpi=100, bbox_inches="tight")
        pngs.append(buf.getvalue())
    plt.close("all")
    return pngs


def _run_cell(ns: dict, code: str, filename: str) -> dict:
    # The cell's lines go into linecache, so a traceback shows them like IPython does.
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    t0 = time.perf_counter()
    value = None
    try:
        body, last = _compile(code, filename)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the kernel's stop button reaches the cell
        try:
            exec(body, ns)
            if last is not None:
                value = eval(last, ns)
        finally:
            signal.signal(signal.SIGINT, _ignore_sigint)
        reply = {"ok": True}
        if value is not None:
            ns["_"] = value
            reply["value"] = repr(value)
    except BaseException as exc:
        signal.signal(signal.SIGINT, _ignore_sigint)
        reply = failure_report(exc, "fn", _THIS)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        reply["figures"] = _figures()
    except Exception as exc:  # a broken figure must not lose the cell's result
        reply["figures"] = []
        print(f"could not render a figure: {exc}", file=sys.stderr)
    reply["seconds"] = time.perf_counter() - t0
    return reply


def _pull(ns: dict, name: str) -> dict:
    if name not in ns:
        return {"ok": False, "message": f"rank {ns['rank']} has no variable {name!r}"}
    try:
        return {"ok": True, "value": transfer.dumps(to_cpu(ns[name]))}
    except Exception as exc:
        return {"ok": False, "message": f"{name} cannot be sent to the notebook ({exc})"}


def main(msg: dict, fds: list[int], life_fd: int) -> int:
    """Entry point in the forked child (see _forkserver.serve); returns the exit code."""
    out_fd, err_fd, ctl_fd = fds
    become_rank(msg, out_fd, err_fd, life_fd)
    signal.signal(signal.SIGINT, _ignore_sigint)
    ctl = socket.socket(fileno=ctl_fd)
    t0 = time.perf_counter()
    try:
        # msg["timeout"] is short (30 s by default, not gloo's 30 min): a rank left waiting in a collective by a
        # peer whose cell failed gets its error back while the learner is still looking at the cell.
        init_group(msg)
        ns = _namespace(msg)
    except BaseException as exc:
        send_msg(ctl, ("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return EXIT_RAISED
    send_msg(ctl, ("ready", time.perf_counter() - t0))
    cells = 0
    while True:
        try:
            req, _ = recv_msg(ctl)
        except KeyboardInterrupt:
            continue
        except OSError:
            req = None
        if req is None or req[0] == "exit":  # EOF: the kernel is gone
            return EXIT_OK
        try:
            if req[0] == "cell":
                cells += 1
                reply = _run_cell(ns, req[1], f"<rank {msg['rank']} cell {cells}>")
            elif req[0] == "pull":
                reply = _pull(ns, req[1])
            else:
                reply = {"ok": False, "message": f"unknown request {req[0]!r}"}
        except KeyboardInterrupt:  # an interrupt that landed between the cell and its reply
            reply = {"ok": False, "etype": "KeyboardInterrupt", "message": "", "time": time.time(),
                     "frames": [], "traceback": "KeyboardInterrupt", "figures": []}
        send_msg(ctl, ("reply", req[-1], reply))
