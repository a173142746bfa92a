"""Checkers for the exercises of notebooks/08_parameter_server.ipynb: a colocated server's bytes (8.1) and a sharded
worker's push and pull (8.2).

8.1: `busiest_nic_bytes(n, model_bytes)`, the bytes that cross the busiest NIC per step in each direction when each
of n machines runs a worker and the server of 1/n of the parameters (the colocated layout BytePS, Jiang et al.
OSDI'20, compares with all-reduce). Compared with every message counted on real colocated runs of 2-4 machines, and
for 1-64 machines with what their shards give (the first N mod n one element longer); every library formula of a
parameter server's or a ring's bytes and every way to start ranks are off while the learner's function runs.

8.2: `push_pull(grad, params, servers)` runs as every worker of a real synchronous PS whose k servers are the
course's own loop (training/ps.py), with shards that differ in size. Collectives are off; each message is checked as
it is posted (only to and from servers, the size of that server's shard, one each way per server per step), so a
wrong split is named on the worker instead of crashing the server in gloo; then the workers' final weights are
compared with single-process SGD on the combined batch (training/tolerance.py's float32 bound).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import chunk_bounds
from ..measure.recorder import event
from ..measure.traffic import Meter
from ..runtime.devices import device
from ..training import ps, tolerance
from ..training.data import load_digits, worker_batch
from ..training.model import flat_grads, flat_params, make_mlp, set_flat_params, train_single
from .algorithms import RING_SHORTCUTS
from .core import ExerciseFailed, call_learner, launch_checked, passed, watched_call, with_hint
from .switch_off import SwitchedOff, _classes, _dispatch_mode_base

STEPS, BATCH, HIDDEN, LR = 3, 16, 32, 0.1
_PS = "course_lib.training.ps."
# A colocated PS moves per NIC what a ring all-reduce moves: every formula of either, and the PS itself, is off.
BYTES_SHORTCUTS = tuple(dict.fromkeys((
    *RING_SHORTCUTS, "course_lib.costs.alpha_beta.ps_vs_allreduce", "course_lib.costs.alpha_beta.byteps_optimal",
    "course_lib.costs.projection.ps_step", "course_lib.costs.projection.ring_step",
    "course_lib.costs.projection.project", *(_PS + f for f in ("ps_train", "_colocated", "_sync_server")))))
# Every function of the PS that pushes or pulls a shard: each one holds 8.2's answer.
PUSH_PULL_SHORTCUTS = tuple(_PS + f for f in ("_push_pull", "_push_pull_pieces", "_pull", "_exchange", "_worker",
                                              "ps_train", "_colocated"))


# ---------------------------------------------------------------- 8.1 the busiest NIC of a colocated PS
def _number(answer) -> float | None:
    """Any real number (int, float, numpy's) or a 0-d tensor, as a float; None for anything else, bools included."""
    if isinstance(answer, bool) or (isinstance(answer, torch.Tensor) and (answer.ndim or answer.dtype == torch.bool
                                                                          or answer.is_complex())):
        return None
    return float(answer) if isinstance(answer, (numbers.Real, torch.Tensor)) else None


def _colocated_bytes(n_elements: int, n: int) -> int:
    """Each way, the machine with the largest shard s: N - s gradient elements out and (n - 1)·s weights out, as many
    in (the first N mod n shards are one element longer, chunk_bounds)."""
    return 4 * (n_elements + (n - 2) * math.ceil(n_elements / n))


def _colocated_run(steps: int):
    return ps.ps_train(steps=steps, colocated=True, hidden=HIDDEN)


def check_busiest_nic_bytes(busiest_nic_bytes, exercise: str = "Exercise 8.1") -> None:
    """`busiest_nic_bytes(n, model_bytes)` -> bytes per step, each way, through the busiest NIC of n machines that
    each run a worker and the server of one shard; within 4n bytes (one float32 per machine) of what real runs
    counted (n = 2-4) and of what the shards give (n = 1, 5, 8, 64)."""
    hint = ("Follow one machine through a step: which pieces of its gradient leave it, which pieces of the others' "
            "gradients come in, which pieces of the new weights go out and come back? Which piece never crosses its "
            "NIC?")
    m = flat_params(make_mlp(HIDDEN, 0)).numel() * 4     # the model ps_train trains with hidden=HIDDEN
    ns = (2, 3, 4, 1, 5, 8, 64)
    got = {}
    for n in ns:
        answer = call_learner(exercise, busiest_nic_bytes, n, m, hint=hint, library=BYTES_SHORTCUTS,
                              why="predicting a colocated parameter server's bytes")
        got[n] = _number(answer)
        if got[n] is None:
            raise ExerciseFailed(with_hint(f"{exercise}: n={n}: you returned {answer!r}, not a number of bytes.", hint))
    for n in (2, 3, 4):
        vals = launch_checked(exercise, _colocated_run, n, args=(1,), hint=hint, what=f"{n} colocated machines")
        assert vals[0]["model_bytes"] == m, "the parameter server trained another model"
        sent, recv = (max(v["traffic"][0][i] for v in vals) for i in (0, 1))
        if max(abs(got[n] - sent), abs(got[n] - recv)) > 4 * n:
            raise ExerciseFailed(with_hint(
                f"{exercise}: n={n} machines, M={m} bytes: you said {got[n]:g}; the busiest NIC really sent {sent} "
                f"and received {recv} bytes in one step.", hint))
    for n in (1, 5, 8, 64):
        if abs(got[n] - _colocated_bytes(m // 4, n)) > 4 * n:
            raise ExerciseFailed(with_hint(f"{exercise}: n={n} machines, M={m} bytes: you said {got[n]:g}, which is "
                                           f"not what the busiest NIC of {n} colocated machines carries each way.",
                                           hint))
    return passed(exercise, "matches the bytes counted on real colocated runs of 2-4 machines, and what 1-64 "
                            "machines carry")


# ---------------------------------------------------------------- 8.2 a sharded worker's push and pull
def _gate(exercise: str, servers: list[int], shard_bytes: list[int]):
    """A dispatch mode that lets a worker's message through only if it goes to or comes from a server, once per
    step each way, with that server's shard size; else SwitchedOff with what was wrong (before gloo would abort)."""
    if "ps_gate" not in _classes:
        class Gate(_dispatch_mode_base()):
            def __init__(self, exercise, servers, shard_bytes):
                super().__init__()
                self.exercise, self.servers, self.want = exercise, servers, shard_bytes
                self.seen = {True: set(), False: set()}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                seen = event(func, args, kwargs)     # the recorder's reading of the call, before it runs
                if seen is not None and seen.kind in ("send", "recv"):
                    problem = self.problem(seen.kind == "send", seen.peer, seen.nbytes)
                    if problem:
                        raise SwitchedOff(f"{self.exercise}: your worker (rank {dist.get_rank()}) {problem}")
                return func(*args, **kwargs)

            def problem(self, sending: bool, peer, size: int) -> str | None:
                if peer == -1:
                    return ("posted a receive without naming its source: a worker knows which server each shard comes "
                            "from (and NCCL has no any-source receive).")
                verb, to = ("sent a message", "to") if sending else ("posted a receive", "from")
                if peer not in self.servers:
                    return (f"{verb} {to} rank {peer}, another worker: in a parameter server a worker talks only to "
                            f"the servers, ranks {self.servers}.")
                i = self.servers.index(peer)
                if i in self.seen[sending]:
                    return (f"{verb} {to} server {i} twice in one step: each server takes one gradient from each "
                            "worker per step and sends its shard back once.")
                if size != self.want[i]:
                    return (f"{verb} of {size} B {to} server {i} (rank {peer}), whose shard is {self.want[i] // 4} "
                            f"float32 ({self.want[i]} B).")
                self.seen[sending].add(i)
                return None

        _classes["ps_gate"] = Gate
    return _classes["ps_gate"](exercise, servers, shard_bytes)


def _ps_with_learner_worker(exercise, push_pull, k: int, steps: int, lr: float):
    """Ranks < k run the course's synchronous server loop on their shard; the others are workers whose push and pull
    after each backward is the learner's. Returns each worker's final flat parameters."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    servers, workers = list(range(k)), list(range(k, world))
    model = make_mlp(HIDDEN, 0).to(dev)
    flat = flat_params(model)
    bounds = chunk_bounds(flat.numel(), k)
    if rank < k:
        lo, hi = bounds[rank]
        ps._sync_server(flat[lo:hi].clone(), workers, steps, lr, Meter())
        return None
    shard_bytes = [(hi - lo) * flat.element_size() for lo, hi in bounds]
    for (lo, hi), s in zip(bounds, servers):      # the first pull, before step 0: not part of the exercise
        dist.recv(flat[lo:hi], s)
    x, y = load_digits()
    for step in range(steps):
        set_flat_params(model, flat)
        xb, yb = worker_batch(x, y, rank - k, len(workers), BATCH, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(xb.to(dev)), yb.to(dev)).backward()
        with _gate(exercise, servers, shard_bytes):
            _, rec = watched_call(exercise, push_pull, (flat_grads(model), flat, servers), forbid="all",
                                  why="a worker's push and pull with sharded servers", library=PUSH_PULL_SHORTCUTS)
        pushed, pulled = sorted(p for p, *_ in rec["sends"]), sorted(p for p, _ in rec["recvs"])
        if pushed != servers or pulled != servers:
            raise SwitchedOff(f"{exercise}: in step {step + 1} your worker (rank {rank}) pushed to servers {pushed} "
                              f"and pulled from {pulled}; each of the servers {servers} waits for one gradient from "
                              "every worker and sends its new shard back to each.")
        if len(rec["completed"]) != len(rec["recvs"]):
            raise SwitchedOff(f"{exercise}: in step {step + 1} your function returned before all its receives had "
                              "completed: a receive's data is in its tensor only once its wait() returns.")
    return flat.cpu()


CASES = ((2, 3), (1, 4), (3, 2))     # (workers, servers): 3 and 4 shards of 3466 parameters differ in size


def check_sharded_push_pull(push_pull, exercise: str = "Exercise 8.2") -> None:
    """`push_pull(grad, params, servers)` after a worker's backward: shard i of `grad` to servers[i], then every
    server's new shard into its place in `params` (in place). Run as every worker of a real PS with 2-4 servers; the
    weights must equal single-process SGD on the combined batch."""
    hint = ("Which elements does server i hold when the k shards cannot be equal (the first N mod k one element "
            "longer)? Does each pulled shard land in params itself, in its place?")
    for n, k in CASES:
        vals = launch_checked(exercise, _ps_with_learner_worker, n + k, args=(exercise, push_pull, k, STEPS, LR),
                              hint=hint, what=f"{n} workers and {k} servers")
        ref = train_single(n, STEPS, BATCH, LR, hidden=HIDDEN)[0]
        # float32: the servers' mean of n gradients vs one mean over the combined batch, summed in another order
        atol = tolerance.sgd_atol(STEPS, LR, n * BATCH, HIDDEN)
        bad = max(tolerance.max_diff(v, ref) for v in vals[k:])
        if bad > atol:
            raise ExerciseFailed(with_hint(
                f"{exercise}: with {n} workers and {k} servers every message went where it should, but the workers' "
                f"final weights differ from single-process SGD on the combined batch by up to {bad:.3g} (float32 "
                f"summation order allows {atol:.1g}).", hint))
    return passed(exercise, "every message to and from the right server with its shard's size, and single-process "
                            "SGD weights, for 1-3 workers with 2-4 servers (unequal shards with 3 and 4)")
