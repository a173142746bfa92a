"""Checkers for the exercises of notebooks/17_multi_node_lab.ipynb: a torchrun command line and global ranks.

The command line is read by torchrun's own argument parser (torch.distributed.run.get_args_parser), so every
spelling torchrun accepts passes (--node-rank=1, --node_rank 1, --nnodes=2:2, ...) and anything torchrun would
refuse fails.
"""

from __future__ import annotations

import ipaddress
import numbers
import shlex
from pathlib import PurePath

from .core import ExerciseFailed, call_learner, passed, with_hint

CASES = [(2, 1, 4, "10.0.0.1", 29400), (4, 0, 8, "head-node", 29500), (3, 2, 1, "192.168.1.7", 12345)]
WORKER = "hello_worker.py"


def _parse(line: str):
    """torchrun's own reading of a command line (after 'torchrun' or 'python -m torch.distributed.run')."""
    from torch.distributed.run import get_args_parser

    words = shlex.split(line)
    start = next((i for i, w in enumerate(words)
                  if w == "torchrun" or w.endswith("/torchrun") or w == "torch.distributed.run"), None)
    if start is None:
        raise ValueError("it does not start torchrun ('torchrun ...' or 'python -m torch.distributed.run ...')")
    try:
        return get_args_parser().parse_args(words[start + 1:])
    except SystemExit:
        raise ValueError("torchrun's argument parser refuses it") from None


def _nodes(nnodes: str) -> tuple[int, int] | str:
    from torch.distributed.run import parse_min_max_nnodes

    try:
        return parse_min_max_nnodes(nnodes)   # "2" and "2:2" both mean exactly two nodes
    except (ValueError, RuntimeError):
        return nnodes


def _loopback(addr: str) -> bool:
    if addr.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _program(a) -> str | None:
    """What the line runs: the worker script (any folder), or None."""
    script = a.training_script
    if (not a.module and PurePath(script).name == WORKER) or (a.module and script == WORKER[:-3]):
        return WORKER
    return f"-m {script}" if a.module else script


def _loopback_options(a) -> list[str]:
    """The options that only several "nodes" on one machine can use: section 2's two, and --standalone."""
    found = []
    if a.standalone:
        # torch's run.py, run(): standalone replaces --rdzv-endpoint by localhost:0 and --rdzv-id by a new uuid
        found.append("--standalone makes torchrun start a rendezvous of its own on this node (it replaces "
                     "--rdzv-endpoint by localhost:0 and --rdzv-id by a fresh one), so each node waits alone for "
                     "the others until the join timeout (600 s); leave it out")
    if a.local_addr and _loopback(a.local_addr):
        found.append(f"--local-addr={a.local_addr} makes this node advertise a loopback address, which on a "
                     "cluster points every other node at itself (leave it out: each node then advertises its host "
                     "name)")
    if "is_host" in (a.rdzv_conf or ""):
        found.append(f"--rdzv-conf={a.rdzv_conf} decides by hand which torchrun hosts the rendezvous store; on a "
                     "cluster the torchrun on the head node finds its own name in --rdzv-endpoint (leave it out)")
    return found


def check_torchrun_line(torchrun_line, exercise: str = "Exercise 17.1") -> None:
    """``torchrun_line(nnodes, node_rank, gpus, head, port)``: the command for one node of a cluster running the
    notebook's ``hello_worker.py`` with c10d rendezvous at head:port; checked for three clusters."""
    hint = ("What must every node tell torchrun: how many nodes, how many processes on this one, how the nodes "
            "meet, and where?")
    for nnodes, node_rank, gpus, head, port in CASES:
        line = call_learner(exercise, torchrun_line, nnodes, node_rank, gpus, head, port, hint=hint,
                            why="writing the torchrun command yourself",
                            library=("course_lib.labs.torchrun.command",))
        if isinstance(line, (list, tuple)) and all(isinstance(w, str) for w in line):
            line = shlex.join(line)   # a word list, as subprocess takes it, is the same command
        try:
            a = _parse(str(line))
        except ValueError as exc:
            raise ExerciseFailed(with_hint(f"{exercise}: {line!r}: {exc}.", hint)) from None
        got = {"--nnodes": _nodes(a.nnodes), "--node-rank": a.node_rank, "--nproc-per-node": a.nproc_per_node,
               "--rdzv-backend": a.rdzv_backend, "--rdzv-endpoint": a.rdzv_endpoint, "program": _program(a)}
        want = {"--nnodes": (nnodes, nnodes), "--node-rank": node_rank, "--nproc-per-node": str(gpus),
                "--rdzv-backend": "c10d", "--rdzv-endpoint": f"{head}:{port}", "program": WORKER}
        # --node-rank is optional: c10d ranks the nodes itself (torch's run.py: "node_rank is only used for static
        # rdzv_backend"); left out it reads as 0. A value that is neither is refused: it says something false.
        wrong = [k for k in want if str(got[k]) != str(want[k]) and not (k == "--node-rank" and got[k] == 0)]
        if wrong:
            shown = {**got, "--nnodes": a.nnodes}
            raise ExerciseFailed(with_hint(
                f"{exercise}: torchrun_{(nnodes, node_rank, gpus, head, port)} gave {line!r}; torchrun reads "
                + ", ".join(f"{k} as {shown[k]!r}" for k in wrong) + ".", hint))
        if local := _loopback_options(a):
            raise ExerciseFailed(with_hint(f"{exercise}: {line!r} works on one machine only: "
                                           + "; ".join(local) + ".", hint))
        if a.local_addr:
            # the address this node advertises (c10d's _NodeDesc); the exercise gives no node its own address
            raise ExerciseFailed(with_hint(
                f"{exercise}: {line!r}: --local-addr={a.local_addr} is the address this node tells the others to "
                f"reach it at, not the rendezvous; the same value on every node points them all at one host "
                f"(MASTER_ADDR would name it even when c10d makes another node node 0). Leave it out: each node "
                f"then advertises its own host name.", hint))
    return passed(exercise, "torchrun's own parser reads the right nodes, node rank, processes, rendezvous and "
                            "script for three clusters, with nothing of the one-machine stand-in left in")


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


NPROCS = ([4, 4], [1, 1, 1], [8, 8, 8], [2, 1], [4, 8, 2], [3, 1, 2])


def check_global_rank(global_rank, ranks_on_node=None, exercise: str = "Exercise 17.2") -> None:
    """``global_rank(node, local_rank, nprocs)`` as torchrun numbers ranks, ``nprocs[k]`` being node k's workers
    (nodes may differ); and ``ranks_on_node(node, nprocs)``: the global ranks that run on that node, in increasing
    order. Nothing is switched off: no library function computes either."""
    hint = ("torchrun numbers the ranks node by node: which global rank does node k's first worker get when the "
            "nodes before it run different numbers of workers?")
    for nprocs in NPROCS:
        for node in range(len(nprocs)):
            first = sum(nprocs[:node])
            for local in range(nprocs[node]):
                got = call_learner(exercise, global_rank, node, local, list(nprocs), hint=hint)
                if not _integer(got):
                    raise ExerciseFailed(with_hint(f"{exercise}: global_rank gave {got!r} ({type(got).__name__}); "
                                                   "a rank is an int.", hint))
                if got != first + local:
                    raise ExerciseFailed(with_hint(f"{exercise}: node {node}, local rank {local}, workers per node "
                                                   f"{nprocs}: you said {got!r}.", hint))
    if ranks_on_node is None:
        return passed(exercise, f"right for {len(NPROCS)} clusters, even and uneven")
    for nprocs in NPROCS:
        for node in range(len(nprocs)):
            first = sum(nprocs[:node])
            got = call_learner(exercise, ranks_on_node, node, list(nprocs), hint=hint)
            values = list(got) if not isinstance(got, (str, bytes)) and hasattr(got, "__iter__") else None
            if values is None or not all(_integer(v) for v in values):
                raise ExerciseFailed(with_hint(f"{exercise}: ranks_on_node gave {got!r}; give a list of ints.", hint))
            if values != list(range(first, first + nprocs[node])):
                raise ExerciseFailed(with_hint(f"{exercise}: the ranks on node {node} with workers per node "
                                               f"{nprocs}: you said {got!r}; how many ranks does node {node} run, "
                                               "and where does its first one start?", hint))
    return passed(exercise, f"global ranks and the ranks on each node right for {len(NPROCS)} clusters, even and "
                            "uneven (no library function was switched off: none computes this)")
