"""Checkers for the exercises of notebooks/17_multi_node_lab.ipynb: a torchrun command line and global ranks.

The command line is read by torchrun's own argument parser (torch.distributed.run.get_args_parser), so every
spelling torchrun accepts passes (--node-rank=1, --node_rank 1, ...) and anything torchrun would refuse fails.
"""

from __future__ import annotations

import shlex

from .core import ExerciseFailed, call_learner, passed, with_hint

CASES = [(2, 1, 4, "10.0.0.1", 29400), (4, 0, 8, "head-node", 29500), (3, 2, 1, "192.168.1.7", 12345)]


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


def check_torchrun_line(torchrun_line, exercise: str = "Exercise 17.1") -> None:
    """``torchrun_line(nnodes, node_rank, gpus, head, port)``: the command for one node of the hello lab
    (course_lib.labs.hello) with c10d rendezvous at head:port; checked for three clusters."""
    hint = ("What must every node tell torchrun: how many nodes, how many processes on this one, how the nodes "
            "meet, and where?")
    for nnodes, node_rank, gpus, head, port in CASES:
        line = call_learner(exercise, torchrun_line, nnodes, node_rank, gpus, head, port, hint=hint,
                            why="writing the torchrun command yourself",
                            library=("course_lib.labs.torchrun.command",))
        try:
            a = _parse(str(line))
        except ValueError as exc:
            raise ExerciseFailed(with_hint(f"{exercise}: {line!r}: {exc}.", hint)) from None
        got = {"--nnodes": a.nnodes, "--node-rank": a.node_rank, "--nproc-per-node": a.nproc_per_node,
               "--rdzv-backend": a.rdzv_backend, "--rdzv-endpoint": a.rdzv_endpoint,
               "module": a.training_script if a.module else None}
        want = {"--nnodes": str(nnodes), "--node-rank": node_rank, "--nproc-per-node": str(gpus),
                "--rdzv-backend": "c10d", "--rdzv-endpoint": f"{head}:{port}", "module": "course_lib.labs.hello"}
        # --node-rank is optional: c10d ranks the nodes itself (torch's run.py: "node_rank is only used for static
        # rdzv_backend"); left out it reads as 0. A value that is neither is refused: it says something false.
        wrong = [k for k in want if str(got[k]) != str(want[k]) and not (k == "--node-rank" and got[k] == 0)]
        if wrong:
            raise ExerciseFailed(with_hint(
                f"{exercise}: torchrun_{(nnodes, node_rank, gpus, head, port)} gave {line!r}; torchrun reads "
                + ", ".join(f"{k} as {got[k]!r}" for k in wrong) + ".", hint))
    return passed(exercise, "torchrun's own parser reads the right nodes, node rank, processes, rendezvous and "
                            "module for three clusters")


def check_global_rank(global_rank, ranks_on_node=None, exercise: str = "Exercise 17.2") -> None:
    """``global_rank(node, local_rank, gpus_per_node)`` as torchrun numbers ranks (node by node); and the second
    question, ``ranks_on_node(node, gpus_per_node)``: the global ranks that run on that node, in increasing order."""
    hint = "How does torchrun number the ranks across nodes: which global rank does node k's first process get?"
    for gpus in (1, 4, 8):
        for node in range(3):
            for local in range(gpus):
                got = call_learner(exercise, global_rank, node, local, gpus, hint=hint)
                if got != node * gpus + local:
                    raise ExerciseFailed(with_hint(f"{exercise}: node {node}, local rank {local}, {gpus} GPUs per "
                                                   f"node: you said {got!r}.", hint))
    if ranks_on_node is None:
        return passed(exercise, "right for 1, 4 and 8 GPUs per node on 3 nodes")
    for gpus in (1, 4, 8):
        for node in range(3):
            got = call_learner(exercise, ranks_on_node, node, gpus, hint=hint)
            if list(got) != list(range(node * gpus, (node + 1) * gpus)):
                raise ExerciseFailed(with_hint(f"{exercise}: the ranks on node {node} with {gpus} GPUs per node: "
                                               f"you said {got!r}; how many ranks does each node run, and where "
                                               f"does node {node}'s first one start?", hint))
    return passed(exercise, "global ranks and the ranks on each node right for 1, 4 and 8 GPUs per node on 3 nodes")
