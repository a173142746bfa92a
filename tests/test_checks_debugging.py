"""Notebook 18's checkers: for each bug hunt, the unfixed script fails, the notebook's fix passes, a fix written
differently passes, and the shortcut fails. The functions are defined as a notebook cell defines them."""

from __future__ import annotations

import pytest
import torch

from course_lib import device
from course_lib.checks import debugging_batchnorm as b
from course_lib.checks import debugging_data as d
from course_lib.checks import debugging_models as m
from course_lib.checks.core import ExerciseFailed

from .conftest import notebook_function

PRELUDE = """
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, Subset
"""


def _fn(src: str, name: str):
    return notebook_function(PRELUDE + src, name, device=device)


def _fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as info:
        check(fn)
    for w in words:
        assert w in str(info.value), str(info.value)


# ------------------------------------------------------------------------------------------- 18.1
LOADER_BUG = """
def make_loader(dataset, batch_size, epoch):
    g = torch.Generator().manual_seed(0)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=g)
"""
LOADER_FIX = """
def make_loader(dataset, batch_size, epoch):
    from torch.utils.data.distributed import DistributedSampler
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
"""
LOADER_OTHER = """
def make_loader(dataset, batch_size, epoch):
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch))
    mine = order[dist.get_rank()::dist.get_world_size()]
    return DataLoader(Subset(dataset, mine.tolist()), batch_size=batch_size)
"""
LOADER_NO_EPOCH = """
def make_loader(dataset, batch_size, epoch):
    from torch.utils.data.distributed import DistributedSampler
    return DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset, shuffle=True, seed=0))
"""
# the shortcut: one fixed shard, read backwards on odd epochs: the order "changes", but only to its reverse
LOADER_REVERSE = """
def make_loader(dataset, batch_size, epoch):
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
    mine = order[dist.get_rank()::dist.get_world_size()].tolist()
    return DataLoader(Subset(dataset, mine[::-1] if epoch % 2 else mine), batch_size=batch_size)
"""


def test_make_loader():
    _fails(d.check_make_loader, _fn(LOADER_BUG, "make_loader"), "distinct")
    d.check_make_loader(_fn(LOADER_FIX, "make_loader"))
    d.check_make_loader(_fn(LOADER_OTHER, "make_loader"))
    _fails(d.check_make_loader, _fn(LOADER_NO_EPOCH, "make_loader"), "same order in epochs 0 and 1")


def test_make_loader_refuses_a_shard_that_only_reverses():
    _fails(d.check_make_loader, _fn(LOADER_REVERSE, "make_loader"), "one order or its reverse")


# ------------------------------------------------------------------------------------------- 18.2
STEP_BUG = """
def train_step(model, opt, xb, yb):
    opt.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
"""
STEP_FIX = """
def train_step(model, opt, xb, yb):
    opt.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    opt.step()
"""
# written differently: no_sync() turns DDP's all-reduce off, and one hand average moves one gradient's worth
STEP_OTHER = """
def train_step(model, opt, xb, yb):
    opt.zero_grad()
    with model.no_sync():
        F.cross_entropy(model(xb), yb).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
"""
# the shortcuts that keep the bug's mechanism: right numbers, but every gradient all-reduced twice (DDP, then by hand)
STEP_DIVIDE = """
def train_step(model, opt, xb, yb):
    opt.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
"""
STEP_LOSS_DIVIDE = """
def train_step(model, opt, xb, yb):
    opt.zero_grad()
    (F.cross_entropy(model(xb), yb) / dist.get_world_size()).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
"""
# the shortcut: keep the sum, shrink the learning rate: the same weights, gradients still world-size times too big
STEP_LR = """
def train_step(model, opt, xb, yb):
    opt.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad / dist.get_world_size()
"""
# the other shortcut: train on this rank's batch alone, as one process would
STEP_LOCAL = """
def train_step(model, opt, xb, yb):
    net = model.module
    net.zero_grad()
    F.cross_entropy(net(xb), yb).backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= 0.1 * p.grad
"""

# the shortcut that hides the gradient: keep the sum, shrink the learning rate, then clear .grad (set_to_none)
STEP_LR_NONE = """
def train_step(model, opt, xb, yb):
    opt.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    for group in opt.param_groups:
        group["lr"] = 0.1 / dist.get_world_size()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def test_train_step():
    _fails(d.check_train_step, _fn(STEP_BUG, "train_step"), "2.00 times")
    d.check_train_step(_fn(STEP_FIX, "train_step"))
    d.check_train_step(_fn(STEP_OTHER, "train_step"))
    _fails(d.check_train_step, _fn(STEP_LR, "train_step"), "times the size")
    _fails(d.check_train_step, _fn(STEP_LOCAL, "train_step"))


def test_train_step_refuses_a_second_all_reduce_of_the_gradients():
    _fails(d.check_train_step, _fn(STEP_DIVIDE, "train_step"), "2.00 times the model's gradients")
    _fails(d.check_train_step, _fn(STEP_LOSS_DIVIDE, "train_step"), "2.00 times the model's gradients")


def test_train_step_sees_the_gradient_inside_opt_step():
    _fails(d.check_train_step, _fn(STEP_LR_NONE, "train_step"), "2.00 times the size")


# ------------------------------------------------------------------------------------------- 18.3
REPLICA_BUG = """
def build_replica():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(device())
"""
REPLICA_FIX = """
def build_replica():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(device())
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)
    return model
"""
REPLICA_OTHER = """
def build_replica():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    return model.to(device())
"""
REPLICA_RESEED = """
def build_replica():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(device())
"""


def test_build_replica():
    _fails(d.check_build_replica, _fn(REPLICA_BUG, "build_replica"), "initial weights differ")
    d.check_build_replica(_fn(REPLICA_FIX, "build_replica"))
    d.check_build_replica(_fn(REPLICA_OTHER, "build_replica"))
    _fails(d.check_build_replica, _fn(REPLICA_RESEED, "build_replica"), "give the same numbers")


# ------------------------------------------------------------------------------------------- 18.4
SYNC_BUG = """
def sync_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
"""
SYNC_FIX = """
def sync_gradients(model):
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
"""
SYNC_OTHER = """
def sync_gradients(model):
    ps = list(model.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    i = 0
    for p in ps:
        p.grad = flat[i:i + p.numel()].view_as(p).clone()
        i += p.numel()
"""
# the shortcut: skip on every rank what any rank skipped (no hang, but the used head's gradient is lost)
SYNC_SKIP = """
def sync_gradients(model):
    for p in model.parameters():
        used = torch.tensor([0.0 if p.grad is None else 1.0], device=p.device)
        dist.all_reduce(used, op=dist.ReduceOp.MIN)
        if used.item():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
"""


def test_sync_gradients():
    _fails(d.check_sync_gradients, _fn(SYNC_BUG, "sync_gradients"))
    d.check_sync_gradients(_fn(SYNC_FIX, "sync_gradients"))
    d.check_sync_gradients(_fn(SYNC_OTHER, "sync_gradients"))
    _fails(d.check_sync_gradients, _fn(SYNC_SKIP, "sync_gradients"))


# ------------------------------------------------------------------------------------------- 18.5
DROP_BUG = """
def tp_dropout(h, step, p=0.5):
    g = torch.Generator(device=h.device).manual_seed(1234 + step)
    keep = torch.rand(h.shape, generator=g, device=h.device) >= p
    return h * keep / (1 - p)
"""
DROP_FIX = """
def tp_dropout(h, step, p=0.5):
    g = torch.Generator(device=h.device).manual_seed(1234 + 2718 + 1000 * step + dist.get_rank())
    keep = torch.rand(h.shape, generator=g, device=h.device) >= p
    return h * keep / (1 - p)
"""
DROP_OTHER = """
def tp_dropout(h, step, p=0.5):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7919 * (step + 1) + dist.get_rank())
        return F.dropout(h, p)
"""
# the shortcut: a different seed per rank in the default generator (masks differ, the shared stream is gone)
DROP_GLOBAL = """
def tp_dropout(h, step, p=0.5):
    torch.manual_seed(100 * step + dist.get_rank())
    return F.dropout(h, p)
"""

# the shortcut: masks differ across ranks and steps, but rank r + 1 at step s repeats rank r at step s + 1
DROP_SHIFT = """
def tp_dropout(h, step, p=0.5):
    g = torch.Generator(device=h.device).manual_seed(1234 + step + dist.get_rank())
    keep = torch.rand(h.shape, generator=g, device=h.device) >= p
    return h * keep / (1 - p)
"""


def test_tp_dropout():
    _fails(m.check_tp_dropout, _fn(DROP_BUG, "tp_dropout"), "ranks 0 and 1")
    m.check_tp_dropout(_fn(DROP_FIX, "tp_dropout"))
    m.check_tp_dropout(_fn(DROP_OTHER, "tp_dropout"))
    _fails(m.check_tp_dropout, _fn(DROP_GLOBAL, "tp_dropout"), "default random generator")


def test_tp_dropout_masks_differ_across_rank_step_pairs():
    _fails(m.check_tp_dropout, _fn(DROP_SHIFT, "tp_dropout"), "rank 0 at step 1 and rank 1 at step 0")


@pytest.mark.parametrize("k", [4, 100])
def test_tp_dropout_masks_differ_at_steps_far_apart(k):
    # seed + step + k * rank: rank 1 at step 0 repeats rank 0 at step k
    src = DROP_SHIFT.replace("+ dist.get_rank()", f"+ {k} * dist.get_rank()")
    _fails(m.check_tp_dropout, _fn(src, "tp_dropout"), f"rank 0 at step {k} and rank 1 at step 0")


# a fix with fork_rng and a seed that mixes step and rank without collisions
DROP_FORK = """
def tp_dropout(h, step, p=0.5):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4321 + step * dist.get_world_size() + dist.get_rank())
        return F.dropout(h, p)
"""


def test_tp_dropout_collision_free_seed_passes():
    m.check_tp_dropout(_fn(DROP_FORK, "tp_dropout"))


# ------------------------------------------------------------------------------------------- 18.6
VOCAB_BODY = """
    logits = h @ W[lo:hi].T
    m = logits.max(dim=1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    e = (logits - m[:, None]).exp()
    s = e.sum(dim=1)
    dist.all_reduce(s)
    mine = (y >= lo) & (y < hi)
    target = torch.zeros_like(m)
    target[mine] = logits[mine, y[mine] - lo]
    dist.all_reduce(target)
    loss = (s.log() + m - target).mean()
    p = e / s[:, None]
    p[mine, y[mine] - lo] -= 1
    grad = torch.zeros_like(W)
    grad[lo:hi] = p.T @ h / len(y)
    return loss, grad
"""
VOCAB_BUG = """
def vocab_parallel_step(h, W, y):
    rank, world = dist.get_rank(), dist.get_world_size()
    per = W.shape[0] // world
    lo, hi = rank * per, (rank + 1) * per
""" + VOCAB_BODY
VOCAB_FIX = """
def vocab_parallel_step(h, W, y):
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * W.shape[0] // world, (rank + 1) * W.shape[0] // world
""" + VOCAB_BODY
VOCAB_PAD = """
def vocab_parallel_step(h, W, y):
    rank, world = dist.get_rank(), dist.get_world_size()
    per = -(-W.shape[0] // world)                      # pad the vocabulary to a multiple of the world size
    lo, hi = rank * per, min((rank + 1) * per, W.shape[0])
""" + VOCAB_BODY
VOCAB_FULL = """
def vocab_parallel_step(h, W, y):
    W = W.clone().requires_grad_()
    loss = F.cross_entropy(h @ W.T, y)
    loss.backward()
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * W.shape[0] // world, (rank + 1) * W.shape[0] // world
    grad = torch.zeros_like(W)
    grad[lo:hi] = W.grad[lo:hi]
    dist.all_reduce(loss.detach().clone())
    return loss.detach(), grad
"""

# the shortcuts: every rank computes the whole vocabulary's logits without a matrix product of that width, keeps its
# own rows' gradient and calls a dummy all-reduce
VOCAB_BROADCAST = """
def vocab_parallel_step(h, W, y):
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * W.shape[0] // world, (rank + 1) * W.shape[0] // world
    W = W.clone().requires_grad_()
    logits = (h[:, None, :] * W[None]).sum(-1)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    grad = torch.zeros_like(W)
    grad[lo:hi] = W.grad[lo:hi]
    dist.all_reduce(torch.zeros(1, device=h.device))
    return loss.detach(), grad
"""
VOCAB_ROWS = """
def vocab_parallel_step(h, W, y):
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * W.shape[0] // world, (rank + 1) * W.shape[0] // world
    W = W.clone().requires_grad_()
    logits = torch.cat([h @ W[i:i + 1].T for i in range(W.shape[0])], 1)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    grad = torch.zeros_like(W)
    grad[lo:hi] = W.grad[lo:hi]
    dist.all_reduce(torch.zeros(1, device=h.device))
    return loss.detach(), grad
"""
# the same, one row's logits at a time and never a batch x vocabulary tensor: only the NaN rows show it
VOCAB_COLUMNS = """
def vocab_parallel_step(h, W, y):
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * W.shape[0] // world, (rank + 1) * W.shape[0] // world
    W = W.clone().requires_grad_()
    cols = [h @ W[i] for i in range(W.shape[0])]
    top = cols[0]
    for c in cols[1:]:
        top = torch.maximum(top, c)
    total = sum((c - top).exp() for c in cols)
    target = sum(torch.where(y == i, c, torch.zeros_like(c)) for i, c in enumerate(cols))
    loss = (total.log() + top - target).mean()
    loss.backward()
    grad = torch.zeros_like(W)
    grad[lo:hi] = W.grad[lo:hi]
    dist.all_reduce(torch.zeros(1, device=h.device))
    return loss.detach(), grad
"""


def test_vocab_parallel():
    _fails(m.check_vocab_parallel, _fn(VOCAB_BUG, "vocab_parallel_step"))
    m.check_vocab_parallel(_fn(VOCAB_FIX, "vocab_parallel_step"))
    m.check_vocab_parallel(_fn(VOCAB_PAD, "vocab_parallel_step"))
    _fails(m.check_vocab_parallel, _fn(VOCAB_FULL, "vocab_parallel_step"), "logits for all")


@pytest.mark.parametrize("src", ["VOCAB_BROADCAST", "VOCAB_ROWS"])
def test_vocab_parallel_refuses_the_whole_vocabulary_however_built(src):
    _fails(m.check_vocab_parallel, _fn(globals()[src], "vocab_parallel_step"), "logits for all")


def test_vocab_parallel_rows_a_rank_does_not_own_are_not_read():
    _fails(m.check_vocab_parallel, _fn(VOCAB_COLUMNS, "vocab_parallel_step"), "read rows of W it does not own")


# ------------------------------------------------------------------------------------------- 18.7
STAGE1 = """
    else:
        for ym in y.chunk(n_micro):
            a = torch.empty(len(ym), 32, device=device())
            dist.recv(a, src=0)
            a.requires_grad_()
            (F.cross_entropy(stage(a), ym) / n_micro).backward()
            dist.send(a.grad, dst=0)
"""
PIPE_BUG = """
def pipeline_step(stage, x, y, n_micro):
    if dist.get_rank() == 0:
        outs = []
        for xm in x.chunk(n_micro):
            out = stage(xm)
            dist.send(out.detach(), dst=1)
            outs.append(out)
        for out in outs:
            g = torch.empty_like(out)
            dist.recv(g, src=1)
            out.backward(g)
""" + STAGE1
PIPE_FIX = """
def pipeline_step(stage, x, y, n_micro):
    if dist.get_rank() == 0:
        chunks = x.chunk(n_micro)
        outs = [stage(chunks[0])]
        dist.send(outs[0].detach(), dst=1)
        for i in range(n_micro):
            g = torch.empty_like(outs[i])
            ops = [dist.P2POp(dist.irecv, g, 1)]
            if i + 1 < n_micro:
                outs.append(stage(chunks[i + 1]))
                ops.append(dist.P2POp(dist.isend, outs[-1].detach(), 1))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            outs[i].backward(g)
""" + STAGE1
# written differently: stage 0 runs the next forward before the gradient arrives, then receives, then sends
PIPE_OTHER = """
def pipeline_step(stage, x, y, n_micro):
    if dist.get_rank() == 0:
        chunks = x.chunk(n_micro)
        outs = [stage(chunks[0])]
        dist.send(outs[0].detach(), dst=1)
        for i in range(n_micro):
            if i + 1 < n_micro:
                outs.append(stage(chunks[i + 1]))
            g = torch.empty_like(outs[i])
            dist.recv(g, src=1)
            if i + 1 < n_micro:
                dist.send(outs[i + 1].detach(), dst=1)
            outs[i].backward(g)
""" + STAGE1
# shortcuts that do not deadlock but are not 1F1B: the whole batch at once, GPipe on both stages, one micro-batch at
# a time on stage 0
PIPE_WHOLE = """
def pipeline_step(stage, x, y, n_micro):
    if dist.get_rank() == 0:
        out = stage(x)
        dist.send(out.detach(), dst=1)
        g = torch.empty_like(out)
        dist.recv(g, src=1)
        out.backward(g)
    else:
        a = torch.empty(len(y), 32, device=device())
        dist.recv(a, src=0)
        a.requires_grad_()
        F.cross_entropy(stage(a), y).backward()
        dist.send(a.grad, dst=0)
"""
PIPE_GPIPE = """
def pipeline_step(stage, x, y, n_micro):
    if dist.get_rank() == 0:
        outs = []
        for xm in x.chunk(n_micro):
            out = stage(xm)
            dist.send(out.detach(), dst=1)
            outs.append(out)
        for out in outs:
            g = torch.empty_like(out)
            dist.recv(g, src=1)
            out.backward(g)
    else:
        held = []
        for ym in y.chunk(n_micro):
            a = torch.empty(len(ym), 32, device=device())
            dist.recv(a, src=0)
            a.requires_grad_()
            held.append((a, F.cross_entropy(stage(a), ym) / n_micro))
        for a, loss in held:
            loss.backward()
            dist.send(a.grad, dst=0)
"""
PIPE_ONE_AT_A_TIME = """
def pipeline_step(stage, x, y, n_micro):
    if dist.get_rank() == 0:
        for xm in x.chunk(n_micro):
            out = stage(xm)
            dist.send(out.detach(), dst=1)
            g = torch.empty_like(out)
            dist.recv(g, src=1)
            out.backward(g)
""" + STAGE1

# the shortcut: stage 1 computes alone on a zero input (no activations sent): no deadlock, wrong gradients
PIPE_ALONE = """
def pipeline_step(stage, x, y, n_micro):
    if dist.get_rank() == 1:
        a = torch.zeros(len(y), 32, device=device())
        F.cross_entropy(stage(a), y).backward()
"""


def test_pipeline_step():
    _fails(m.check_pipeline_step, _fn(PIPE_BUG, "pipeline_step"), "deadlock")
    m.check_pipeline_step(_fn(PIPE_FIX, "pipeline_step"))
    m.check_pipeline_step(_fn(PIPE_OTHER, "pipeline_step"))
    _fails(m.check_pipeline_step, _fn(PIPE_ALONE, "pipeline_step"), "received 0 messages")


@pytest.mark.parametrize("src, words", [("PIPE_WHOLE", "sent 1 and received 1 messages"),
                                        ("PIPE_GPIPE", "1F1B on 2 stages runs F B F B"),
                                        ("PIPE_ONE_AT_A_TIME", "1F1B on 2 stages runs F F B B")])
def test_pipeline_step_is_1f1b_with_one_message_per_micro_batch(src, words):
    _fails(m.check_pipeline_step, _fn(globals()[src], "pipeline_step"), words)


# ------------------------------------------------------------------------------------------- 18.8
BN_BUG = """
def global_batch_stats(h):
    return h.mean(0), h.var(0, unbiased=False)
"""
BN_FIX = """
def global_batch_stats(h):
    class SumOverRanks(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            t = t.clone()
            dist.all_reduce(t)
            return t

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad)
            return grad

    n = torch.tensor([float(len(h))], device=h.device)
    dist.all_reduce(n)
    sums = SumOverRanks.apply(torch.cat([h.sum(0), (h * h).sum(0)]))
    mean, mean_sq = (sums / n).chunk(2)
    return mean, mean_sq - mean * mean
"""
BN_OTHER = """
def global_batch_stats(h):
    import warnings
    import torch.distributed.nn.functional as dnn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        mean = dnn.all_reduce(h.mean(0)) / dist.get_world_size()        # equal batches on every rank
        var = dnn.all_reduce(((h - mean) ** 2).mean(0)) / dist.get_world_size()
    return mean, var
"""
# the shortcut: right forward statistics, but the gradient does not flow through the other ranks' share
BN_DETACHED = """
def global_batch_stats(h):
    s = torch.cat([h.sum(0), (h * h).sum(0)]).detach()
    dist.all_reduce(s)
    n = len(h) * dist.get_world_size()
    mean = (s[:h.shape[1]] - h.sum(0).detach() + h.sum(0)) / n
    mean_sq = (s[h.shape[1]:] - (h * h).sum(0).detach() + (h * h).sum(0)) / n
    return mean, mean_sq - mean * mean
"""


def test_global_batch_stats():
    _fails(b.check_global_batch_stats, _fn(BN_BUG, "global_batch_stats"), "batch mean or variance")
    b.check_global_batch_stats(_fn(BN_FIX, "global_batch_stats"))
    b.check_global_batch_stats(_fn(BN_OTHER, "global_batch_stats"))
    _fails(b.check_global_batch_stats, _fn(BN_DETACHED, "global_batch_stats"), "look at the gradient")


def test_the_secret_data_is_not_the_digits():
    x, y = d._secret_batch(0, 0)
    assert x.shape == (d.BATCH, 64) and set(y.tolist()) <= set(range(10)) and not torch.equal(x, x.round())
