"""Checkers for the exercises of notebooks 08-10 (parameter server, all-reduce data parallel, PS vs all-reduce).

Each runs the learner's function on real ranks (or against real measured traffic) and compares with the course's
reference: single-process SGD on the combined batch, dist.all_reduce, the bytes counted on every message.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import costmodel
from ..launch import run
from ..measure.traffic import Meter
from ..results import RankFailed
from ..training import train_single
from ..training.allreduce import dp_train
from ..training.data import load_digits, worker_batch
from ..training.model import flat_params, make_mlp
from ..training.ps import _worker, ps_train
from .core import ExerciseFailed

STEPS, BATCH = 3, 16


def _launch(exercise, fn, world, args=(), hint="", kwargs=None):
    try:
        return run(fn, world_size=world, args=args, kwargs=kwargs, output="none", timeout=30).values
    except RankFailed as e:
        if e.failure.etype == "NotImplementedError":   # a student copy: the exercise is not done yet
            raise NotImplementedError(f"{exercise}: {e.failure.message}") from None
        raise ExerciseFailed(f"{exercise}: rank {e.rank} failed with {world} ranks:\n{e}\nHint: {hint}") from None


def _passed(exercise: str, what: str) -> None:
    print(f"PASS {exercise}: {what}")


def check_server_bytes(server_bytes, exercise: str = "Exercise 8.1 (bytes through one server)") -> None:
    """`server_bytes(n, model_bytes, k)` -> bytes ONE server receives per synchronous step; checked against what
    the course's PS really received (every message counted) for several n and k."""
    for n, k in [(1, 1), (3, 1), (2, 2), (4, 2)]:
        got = _launch(exercise, ps_train, n + k, kwargs=dict(steps=1, n_servers=k))
        m = got[0]["model_bytes"]
        measured = got[0]["traffic"][0][1]
        answer = server_bytes(n, m, k)
        if answer != measured:
            raise ExerciseFailed(f"{exercise}: n={n} workers, k={k} servers, M={m} bytes: you said {answer}, "
                                 f"server 0 really received {measured} bytes per step.\nHint: every worker pushes "
                                 f"its gradient for the server's shard only (M/k bytes).")
    _passed(exercise, "matches the bytes counted on real runs for n in 1-4 and k in 1-2")


def _ps_with_learner_server(server_step, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_mlp(256, 0)
    flat = flat_params(model)
    workers = list(range(1, world))
    meter = Meter()
    if rank == 0:
        shard = flat.clone()
        for _ in range(steps):
            server_step(shard, workers, 0.1)
        for w in workers:
            dist.send(shard, w)
        return shard
    _worker(model, [(0, flat.numel())], [0], steps, BATCH, 0, "sync", meter, rank - 1, len(workers))
    return flat_params(model)


def check_sync_server_step(server_step, exercise: str = "Exercise 8.2 (one synchronous server step)") -> None:
    """`server_step(shard, workers, lr)`: send `shard` to every worker, receive one gradient from each, update
    `shard` in place with the average. Run as the server of a real PS; final weights must equal single-process SGD."""
    hint = "send first, then receive one gradient per worker, then shard -= lr * mean (in place: shard -= ...)"
    for n in (1, 2, 3):
        vals = _launch(exercise, _ps_with_learner_server, n + 1, args=(server_step, STEPS), hint=hint)
        ref, _ = train_single(n, STEPS, BATCH)
        if not all(torch.allclose(v, ref, atol=1e-5) for v in vals):
            bad = max((v - ref).abs().max().item() for v in vals)
            raise ExerciseFailed(f"{exercise}: with {n} workers the weights differ from single-process SGD on the "
                                 f"combined batch by up to {bad:.3g}.\nHint: {hint}")
    _passed(exercise, "a real PS with your server step ends with single-process weights for 1-3 workers")


def _dp_with_learner(average_gradients, steps):
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = load_digits()
    model = make_mlp(256, 0)
    for step in range(steps):
        xb, yb = worker_batch(x, y, rank, n, BATCH, step)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        average_gradients(model)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return flat_params(model)


def check_average_gradients(average_gradients, exercise: str = "Exercise 9.1 (average the gradients)") -> None:
    """`average_gradients(model)`: after backward, make every p.grad the mean over ranks. Trained on real ranks;
    every rank must end with the single-process weights."""
    hint = "dist.all_reduce(p.grad) sums; divide by dist.get_world_size()"
    for n in (2, 3):
        vals = _launch(exercise, _dp_with_learner, n, args=(average_gradients, STEPS), hint=hint)
        ref, _ = train_single(n, STEPS, BATCH)
        if not all(torch.allclose(v, ref, atol=1e-5) for v in vals):
            raise ExerciseFailed(f"{exercise}: with {n} ranks the weights differ from single-process SGD.\n"
                                 f"Hint: {hint}")
    _passed(exercise, "every rank ends with the single-process weights for 2 and 3 ranks")


def _bucket_case(bucket_all_reduce):
    rank = dist.get_rank()
    ts = [torch.arange(s, dtype=torch.float32) * (rank + 1) + rank for s in (3, 1, 7, 12)]
    want = [t.clone() for t in ts]
    for t in want:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    calls = {"n": 0}
    orig = dist.all_reduce

    def counting(*a, **k):
        calls["n"] += 1
        return orig(*a, **k)

    dist.all_reduce = counting
    try:
        bucket_all_reduce(ts)
    finally:
        dist.all_reduce = orig
    return calls["n"], all(torch.allclose(a, b) for a, b in zip(ts, want))


def check_bucket_all_reduce(bucket_all_reduce, exercise: str = "Exercise 9.2 (one bucket, one all-reduce)") -> None:
    """`bucket_all_reduce(tensors)`: average every tensor of the list over ranks, in place, with ONE all_reduce."""
    hint = "torch.cat([t.reshape(-1) for t in tensors]), one dist.all_reduce, divide, copy slices back"
    for n in (2, 3, 4):
        vals = _launch(exercise, _bucket_case, n, args=(bucket_all_reduce,), hint=hint)
        for rank, (calls, ok) in enumerate(vals):
            if not ok:
                raise ExerciseFailed(f"{exercise}: rank {rank} of {n}: tensors are not the mean over ranks.\n"
                                     f"Hint: {hint}")
            if calls != 1:
                raise ExerciseFailed(f"{exercise}: rank {rank} called dist.all_reduce {calls} times; the point of a "
                                     f"bucket is one call for all four tensors.\nHint: {hint}")
    _passed(exercise, "means are right on 2-4 ranks with exactly one all_reduce call")


def _ring_bytes_case():
    out = dp_train(steps=1, batch_size=8, hidden=60, method="bucket", collective="ring", bucket_bytes=1 << 30)
    return out["traffic"][0][0], out["model_bytes"]


def check_ring_bytes(ring_bytes, exercise: str = "Exercise 10.1 (bytes a rank sends in ring all-reduce)") -> None:
    """`ring_bytes(n, model_bytes)` -> bytes each rank sends per ring all-reduce; checked against real ring runs
    (every message counted) within one element per phase (the chunks differ by at most one element)."""
    for n in (2, 3, 4):
        vals = _launch(exercise, _ring_bytes_case, n)
        m = vals[0][1]
        ans = ring_bytes(n, m)
        worst = max(abs(ans - sent) for sent, _ in vals)
        if worst > 8:
            raise ExerciseFailed(f"{exercise}: n={n}, M={m}: you said {ans:.0f}, ranks really sent "
                                 f"{[s for s, _ in vals]} bytes.\nHint: reduce-scatter then all-gather, each "
                                 f"n-1 steps of a 1/n chunk.")
    _passed(exercise, "matches the bytes counted on real ring runs for 2-4 ranks")


def check_servers_to_match_ring(servers_needed, exercise: str = "Exercise 10.2 (servers a PS needs)") -> None:
    """`servers_needed(n)` -> the smallest k for which BytePS's PS time max(M/B, nM/(kB)) is at most ring
    all-reduce's 2(n-1)M/(nB) (any M, B); compared with costmodel.ps_vs_allreduce for n = 2..64."""
    for n in range(2, 65):
        want = next(k for k in range(1, n + 1)
                    if costmodel.ps_vs_allreduce(n, 1.0, 1.0, k)["ps_s"]
                    <= costmodel.ps_vs_allreduce(n, 1.0, 1.0, k)["allreduce_s"] + 1e-12)
        if servers_needed(n) != want:
            raise ExerciseFailed(f"{exercise}: n={n}: you said {servers_needed(n)}, the formulas give {want}.\n"
                                 f"Hint: solve n/k <= 2(n-1)/n for k and round up.")
    _passed(exercise, "right for every n from 2 to 64")
