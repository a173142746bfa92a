"""Checkers for notebook 18 (debugging distributed training), hunts 1-4 (data parallel): each runs the learner's fixed
code on real ranks against a single-process reference computed here, on data the learner's code never saw.

Each checks that the hunt's bug is gone, not only that a loss looks right: every sample read by exactly one rank per
epoch, each rank's order not one order and its reverse (18.1); the gradient that a DDP step's optimizer sees,
captured inside `opt.step()`, equal to the single-process gradient, and no more than one gradient's worth of bytes in
collectives per step (18.2); identical replicas with the per-rank random stream kept (18.3); the
same collectives in the same order on every rank under TORCH_DISTRIBUTED_DEBUG=DETAIL (18.4). Hunts 5-8 are in
debugging_models. Tolerances come from course_lib.training.tolerance.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from ..runtime.launch import run
from ..runtime.results import RankFailed
from ..training import tolerance
from ..training.model import flat_params, make_mlp
from .core import ExerciseFailed, explain, launch_checked, learner_rules, passed, watched_call, with_hint
from .watch import summary

HIDDEN, BATCH, STEPS, LR = 16, 8, 3, 0.1


def _secret_batch(rank: int, step: int, n: int = BATCH, seed: int = 18):
    """Inputs and labels the learner's code has never seen: random pixels in 0..1, every class present."""
    g = torch.Generator().manual_seed(seed * 1000 + 31 * rank + step)
    x = torch.rand(n, 64, generator=g)
    y = (torch.arange(n) + 3 * rank + step) % 10
    return x, y


def _dev(*ts):
    return [t.to(device()) for t in ts]

# ------------------------------------------------------------------------------------------- 18.1 data shards
def _loader_case(exercise, make_loader, sizes, batch):
    from torch.utils.data import TensorDataset

    out = {}
    for n in sizes:
        data = TensorDataset(torch.rand(n, 3), torch.arange(n))       # the label of sample i is i
        epochs = []
        for epoch in (0, 1, 2):
            loader, _ = watched_call(exercise, make_loader, (data, batch, epoch))
            epochs.append([[int(i) for i in yb] for _, yb in loader])
        out[n] = epochs
    return out


def check_make_loader(make_loader, exercise: str = "Exercise 18.1") -> None:
    """`make_loader(dataset, batch_size, epoch)` -> what this rank iterates over in that epoch, batches of
    (inputs, labels). Every sample must be read by one rank per epoch, each rank's order must change between epochs,
    and over epochs 0, 1, 2 not only between one order and its reverse."""
    hint = ("Count how many times each sample is read in one epoch, over all ranks together. What does a rank know "
            "that tells it which part of the data is its own, and what changes from one epoch to the next?")
    sizes, batch = (48, 50), 4
    for world in (2, 3):
        vals = launch_checked(exercise, _loader_case, world, args=(exercise, make_loader, sizes, batch), hint=hint,
                              what=f"{world} ranks")
        for n in sizes:
            for epoch in (0, 1, 2):
                reads = [i for v in vals for b in v[n][epoch] for i in b]
                counts = Counter(reads)
                repeats, missing = len(reads) - len(counts), n - len(counts)
                # DistributedSampler pads with up to world - 1 repeats (drop_last=False) or drops as many (True)
                if repeats > world - 1 or missing > world - 1:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks, {n} samples, epoch {epoch}: the ranks read {len(reads)} samples "
                        f"in all, {len(counts)} distinct; {repeats} reads were of a sample some rank had already "
                        f"read, {missing} samples were read by no rank.", hint))
            for rank, v in enumerate(vals):
                sizes_seen = [len(b) for b in v[n][0]]
                if any(s != batch for s in sizes_seen[:-1]):
                    raise ExerciseFailed(with_hint(f"{exercise}: rank {rank} got batches of {sizes_seen} samples; "
                                                   f"batch_size was {batch}.", hint))
                if v[n][0] == v[n][1]:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks, {n} samples: rank {rank} read the same samples in the same "
                        "order in epochs 0 and 1.", hint))
                flat = [tuple(i for b in v[n][e] for i in b) for e in (0, 1, 2)]
                if len({min(o, o[::-1]) for o in flat}) < 2:         # one order, or it and its reverse
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks, {n} samples: over epochs 0, 1 and 2, rank {rank} read the same "
                        "samples in one order or its reverse: that is not a new order each epoch.", hint))
    return passed(exercise, "on 2 and 3 ranks, 48 and 50 samples, every sample was read by one rank per epoch and "
                            "each rank's order changed from epoch to epoch")


# ------------------------------------------------------------------------------------------- 18.2 DDP step
def _flat_grads(net):
    ps = list(net.parameters())
    return None if any(p.grad is None for p in ps) else torch.cat([p.grad.reshape(-1) for p in ps]).cpu().clone()


def _ddp_case(exercise, train_step, steps, lr):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    dev = device()
    model = DDP(make_mlp(HIDDEN, 0).to(dev), device_ids=[dev] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    seen = []            # the gradients opt.step() steps with, captured inside it: a later zero_grad cannot hide them
    opt.register_step_pre_hook(lambda *_: seen.append(_flat_grads(model.module)))
    weights, grads, moved = [flat_params(model.module).cpu()], [], []
    for step in range(steps):
        xb, yb = _dev(*_secret_batch(rank, step))
        seen.clear()
        _, record = watched_call(exercise, train_step, (model, opt, xb, yb),
                                 library=("course_lib.training.allreduce.dp_train",))
        weights.append(flat_params(model.module).cpu())
        grads.append(seen[-1] if seen else _flat_grads(model.module))    # no opt.step(): the .grad it leaves
        # the step's collectives, DDP's bucket all-reduces included (they reach the dispatcher too), less broadcasts:
        # DDP broadcasts its rebuilt bucket layout after the first iteration, a few bytes that average nothing
        moved.append([c for c in summary(record)["collective_calls"] if c[0] != "broadcast"])
    return weights, grads, moved


def _ddp_reference(world, steps, lr):
    model = make_mlp(HIDDEN, 0)
    weights, grads = [flat_params(model)], []
    for step in range(steps):
        parts = [_secret_batch(r, step) for r in range(world)]
        xb, yb = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        weights.append(flat_params(model))
    return weights, grads


def check_train_step(train_step, exercise: str = "Exercise 18.2") -> None:
    """`train_step(model, opt, xb, yb)`: one SGD step of a DDP-wrapped model on this rank's batch. The gradient
    `opt.step()` steps with (or, without it, the .grad left after the step) and the weights after it must equal
    single-process SGD on all ranks' batches at once, on every rank. The step's collectives (DDP's bucket
    all-reduces and any of the learner's) may move at most one gradient's worth of bytes: DDP's averaging, once."""
    hint = ("Compare one step's gradient with the single-process gradient: what factor separates them, and which "
            "line of the step sums, and which averages?")
    traffic_hint = ("Count how many times each gradient crosses between ranks in one step: which call in your step "
                    "communicates, and what has already happened by the time it runs?")
    for world in (2, 3):
        vals = launch_checked(exercise, _ddp_case, world, args=(exercise, train_step, STEPS, LR), hint=hint,
                              what=f"{world} ranks", timeout=60)
        ref_w, ref_g = _ddp_reference(world, STEPS, LR)
        g_tol = tolerance.grad_atol(world * BATCH, HIDDEN)
        w_tol = tolerance.sgd_atol(STEPS, LR, world * BATCH, HIDDEN)
        grad_bytes = sum(p.numel() * p.element_size() for p in make_mlp(HIDDEN, 0).parameters())
        for rank, (weights, grads, moved) in enumerate(vals):
            for step in range(STEPS):
                if grads[step] is None:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks, step {step}: rank {rank} left a parameter's .grad as None (inside "
                        "opt.step(), or after your step if it does not call it), so the gradient it stepped with "
                        "cannot be compared with the single-process one.", hint))
                if tolerance.max_diff(grads[step], ref_g[step]) > g_tol:
                    ratio = (grads[step].double().norm() / ref_g[step].double().norm()).item()
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks, step {step}: rank {rank}'s gradient after your step is "
                        f"{ratio:.2f} times the size of the single-process gradient on all {world * BATCH} samples "
                        f"(float32 summation order allows {g_tol:.1g} per entry).", hint))
                bad = tolerance.max_diff(weights[step + 1], ref_w[step + 1])
                if bad > w_tol:
                    step_len = (weights[step + 1] - weights[step]).double().norm()
                    should = (ref_w[step + 1] - ref_w[step]).double().norm()
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks, step {step}: rank {rank}'s weights differ from single-process "
                        f"SGD by up to {bad:.3g} (float32 summation order allows {w_tol:.1g}); the step moved them "
                        f"{(step_len / should).item():.2f} times as far as the single-process step.", hint))
                calls = moved[step]
                if sum(c[1] for c in calls) > grad_bytes:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks, step {step}: rank {rank}'s step made {len(calls)} collective "
                        f"calls moving {sum(c[1] for c in calls)} bytes, {sum(c[1] for c in calls) / grad_bytes:.2f} "
                        f"times the model's gradients ({grad_bytes} bytes); averaging them once is one gradient's "
                        "worth.", traffic_hint))
    return passed(exercise, "on 2 and 3 ranks, every step's gradient and weights equal single-process SGD on the "
                            "combined batch, with one gradient's worth of bytes in collectives per step")


# ------------------------------------------------------------------------------------------- 18.3 replicas
def _replica_case(exercise, build_replica):
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)            # the script's per-rank seed: augmentation and dropout differ per rank
    model, _ = watched_call(exercise, build_replica, ())
    if not isinstance(model, nn.Module):
        raise TypeError(f"build_replica returned {type(model).__name__}, not a torch.nn.Module")
    return flat_params(model).cpu(), torch.rand(6)


def check_build_replica(build_replica, exercise: str = "Exercise 18.3") -> None:
    """`build_replica()` runs after `torch.manual_seed(100 + rank)` and returns this rank's model. Every rank's model
    must hold the same weights, and the default generator must still give each rank its own numbers afterwards."""
    hint = ("Two things must hold after build_replica: which one must be equal on every rank, and which one must "
            "differ? Which rank's weights could the others take, and how?")
    for world in (2, 3):
        vals = launch_checked(exercise, _replica_case, world, args=(exercise, build_replica), hint=hint,
                              what=f"{world} ranks")
        first = vals[0][0]
        if first.numel() == 0 or first.std() < 1e-3:
            raise ExerciseFailed(with_hint(f"{exercise}: rank 0's model has {first.numel()} weights, all (nearly) "
                                           "equal: that is not a random initialisation.", hint))
        for rank, (flat, _) in enumerate(vals[1:], 1):
            if flat.shape != first.shape or not torch.equal(flat, first):
                diff = tolerance.max_diff(flat, first) if flat.shape == first.shape else float("nan")
                raise ExerciseFailed(with_hint(f"{exercise}: {world} ranks: rank {rank}'s initial weights differ "
                                               f"from rank 0's by up to {diff:.3g}.", hint))
        streams = [after for _, after in vals]
        if any(torch.equal(streams[0], s) for s in streams[1:]):
            raise ExerciseFailed(with_hint(
                f"{exercise}: {world} ranks: after build_replica, the ranks' default generators give the same "
                "numbers: the per-rank random stream the script seeded (augmentation, dropout) is gone.", hint))
    return passed(exercise, "on 2 and 3 ranks every replica starts from the same weights, and each rank keeps its own "
                            "random stream")


# ------------------------------------------------------------------------------------------- 18.4 collective order
class Branchy(nn.Module):
    """A trunk, a head, and an auxiliary head that only some ranks' batches use."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.aux, self.head = nn.Linear(64, hidden), nn.Linear(hidden, 2), nn.Linear(hidden, 10)

    def forward(self, x, use_aux: bool):
        h = torch.relu(self.trunk(x))
        return self.head(h), (self.aux(h) if use_aux else None)


def _sync_case(exercise, sync_gradients):
    rank = dist.get_rank()
    model = Branchy().to(device())
    xb, yb = _dev(*_secret_batch(rank, 0))
    out, aux = model(xb, use_aux=rank % 2 == 0)
    loss = nn.functional.cross_entropy(out, yb) + (aux.pow(2).mean() if aux is not None else 0.0)
    loss.backward()
    local = [None if p.grad is None else p.grad.detach().cpu().clone() for p in model.parameters()]
    _, record = watched_call(exercise, sync_gradients, (model,),
                             why="gradient synchronisation that every rank agrees on",
                             library=("course_lib.training.allreduce.dp_train",))
    after = [None if p.grad is None else p.grad.detach().cpu().clone() for p in model.parameters()]
    return local, after, record


def check_sync_gradients(sync_gradients, exercise: str = "Exercise 18.4") -> None:
    """`sync_gradients(model)`: average every parameter's gradient over ranks, where some ranks did not use some
    parameters (their .grad is None). Run under TORCH_DISTRIBUTED_DEBUG=DETAIL; every rank must call the same
    collectives in the same order and end with the average (a rank that did not use a parameter counts zero)."""
    hint = ("Print the list of collectives each rank calls, in order, next to each other. Which entries differ, and "
            "what does a rank that did not use a parameter contribute to the average?")
    names = [n for n, _ in Branchy().named_parameters()]
    for world in (2, 3):
        try:
            vals = run(_sync_case, world, args=(exercise, sync_gradients), timeout=20, output="none",
                       check_collectives=True, nccl_rules=learner_rules("auto")).values
        except RankFailed as exc:
            raise explain(exercise, exc, f"{world} ranks (ranks {list(range(0, world, 2))} used the auxiliary head)",
                          hint) from None
        calls = [[(c[0], c[1]) for c in summary(rec)["collective_calls"]] for _, _, rec in vals]
        for rank in range(1, world):
            if calls[rank] != calls[0]:
                raise ExerciseFailed(with_hint(f"{exercise}: {world} ranks: rank 0 called {calls[0]} (collective, "
                                               f"bytes), rank {rank} called {calls[rank]}.", hint))
        for i, name in enumerate(names):
            parts = [local[i] for local, _, _ in vals if local[i] is not None]
            want = torch.stack(parts).sum(0) / world
            tol = tolerance.sum_atol(world, float(torch.stack(parts).abs().sum(0).max()))
            for rank, (_, after, _) in enumerate(vals):
                if after[i] is None:
                    raise ExerciseFailed(with_hint(f"{exercise}: {world} ranks: rank {rank}'s {name}.grad is None "
                                                   "after your function; every replica must take the same step.",
                                                   hint))
                bad = tolerance.max_diff(after[i], want)
                if bad > tol:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks: rank {rank}'s {name}.grad differs from the average over ranks "
                        f"by up to {bad:.3g} (float32 summation order allows {tol:.1g}).", hint))
    return passed(exercise, "on 2 and 3 ranks, with some ranks not using a head, every rank called the same "
                            "collectives in the same order and ended with the average gradient")
