"""Checkers for notebook 18 (debugging distributed training), hunts 5-7 (model parallel): each runs the
learner's fixed code on real ranks against a single-process reference computed here.

Dropout masks that differ across tensor-parallel ranks and across (rank, step) pairs, change every step, repeat for
recomputation and leave the default generator alone (18.5); every vocabulary row owned by exactly one rank, no rank
making a batch x vocabulary tensor, and no rank reading rows it does not own (they are NaN on a second run) (18.6);
a 1F1B pipeline step, its forwards and backwards in 1F1B order and one message per micro-batch each way, that does
not deadlock under the NCCL rules for 1, 2 and 4 micro-batches (18.7). BatchNorm (18.8) is in debugging_batchnorm.
Tolerances come from course_lib.training.tolerance.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from ..measure.c10d_ops import everything_but
from ..runtime.launch import run
from ..runtime.results import RankFailed
from ..training import tolerance
from ..training.pipeline_schedules import one_f_one_b_order
from .core import ExerciseFailed, explain, launch_checked, learner_rules, passed, watched_call, with_hint
from .debugging_data import _dev, _secret_batch
from .watch import summary


# ------------------------------------------------------------------------------------------- 18.5 dropout seeds
def _generator_states():
    states = [torch.get_rng_state()]
    if device().type == "cuda":
        states.append(torch.cuda.get_rng_state(device()))
    return states


STEPS_5 = (0, 1, 2, 3, 4, 7, 100, 1000, 10007, 0)   # some far apart; the last repeats step 0 (recomputation)


def _dropout_case(exercise, tp_dropout, shape):
    out = []
    before = _generator_states()
    for step in STEPS_5:
        h = torch.ones(shape, device=device())
        got, _ = watched_call(exercise, tp_dropout, (h, step))
        out.append(got.detach().cpu())
    after = _generator_states()
    return out, all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(before, after))


def _agreement(a, b) -> float:
    return (a > 0).eq(b > 0).float().mean().item()


def check_tp_dropout(tp_dropout, exercise: str = "Exercise 18.5") -> None:
    """`tp_dropout(h, step, p=0.5)`: dropout on this tensor-parallel rank's slice of the hidden activation. Masks must
    differ across ranks and across (rank, step) pairs, change with the step, repeat for the same (rank, step)
    (activation recomputation) and leave the default generator as it was (it must stay in step on every rank)."""
    hint = ("Which generator does your mask come from, and what is it seeded with on each rank? Which numbers must "
            "be equal across the tensor-parallel ranks, and which must differ?")
    shape, p = (16, 32), 0.5
    n = shape[0] * shape[1]
    for world in (2, 4):
        vals = launch_checked(exercise, _dropout_case, world, args=(exercise, tp_dropout, shape), hint=hint,
                              what=f"{world} ranks")
        for rank, (outs, untouched) in enumerate(vals):
            for o in outs:
                if o.shape != torch.Size(shape):
                    raise ExerciseFailed(with_hint(f"{exercise}: rank {rank} returned shape {tuple(o.shape)} for an "
                                                   f"input of {shape}.", hint))
                values = set(o.unique().tolist())
                if not values <= {0.0, 1 / (1 - p)}:
                    raise ExerciseFailed(with_hint(f"{exercise}: rank {rank}: an input of ones came back as the "
                                                   f"values {sorted(values)[:4]}; dropout keeps each entry scaled by "
                                                   f"1/(1-p) = {1 / (1 - p):g} or zeroes it.", hint))
                kept = (o > 0).float().mean().item()
                if abs(kept - (1 - p)) > 5 * math.sqrt(p * (1 - p) / n):       # five standard deviations
                    raise ExerciseFailed(with_hint(f"{exercise}: rank {rank} kept {kept:.0%} of {n} entries with "
                                                   f"p={p}.", hint))
            if not torch.equal(outs[0], outs[-1]):
                raise ExerciseFailed(with_hint(
                    f"{exercise}: rank {rank} gave two different masks for step 0: recomputing a layer's activations "
                    "in backward (activation checkpointing) needs the same mask again.", hint))
            if torch.equal(outs[0], outs[1]):
                raise ExerciseFailed(with_hint(f"{exercise}: rank {rank} used the same mask at steps 0 and 1.", hint))
            if not untouched:
                raise ExerciseFailed(with_hint(
                    f"{exercise}: rank {rank}: the default random generator changed inside tp_dropout; it decides "
                    "what must stay equal on every rank (weights, data order), so a per-rank draw from it puts the "
                    "ranks out of step.", hint))
        for a in range(world):
            for b in range(a + 1, world):
                same = _agreement(vals[a][0][0], vals[b][0][0])
                if same > 0.75:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks, step 0: ranks {a} and {b} kept or dropped the same entry in "
                        f"{same:.0%} of places; independent masks agree in about half.", hint))
        # every (rank, step) pair its own mask: seed + step + k * rank repeats rank r + 1's mask at step s as rank
        # r's at step s + k, so compare every pair, at steps far apart too
        masks = [((r, step), vals[r][0][k]) for r in range(world) for k, step in enumerate(STEPS_5[:-1])]
        for i, (who, m) in enumerate(masks):
            for other, m2 in masks[i + 1:]:
                same = _agreement(m, m2)
                if same > 0.75:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {world} ranks: rank {who[0]} at step {who[1]} and rank {other[0]} at step "
                        f"{other[1]} kept or dropped the same entry in {same:.0%} of places; independent masks agree "
                        "in about half.", hint))
    return passed(exercise, "on 2 and 4 ranks, steps 0 to 10007: the masks differ across ranks, steps and (rank, "
                            "step) pairs, repeat for the same step, and the default generator is left alone")


# ------------------------------------------------------------------------------------------- 18.6 vocabulary
def _logit_watch(batch, vocab):
    from .switch_off import _dispatch_mode_base

    class FullLogits(_dispatch_mode_base()):
        """Notes any floating-point result, made from floating-point inputs, with a dimension for every sample and one
        for every vocabulary row: the whole vocabulary's logits, however they were put together."""

        def __init__(self):
            super().__init__()
            self.seen = ""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if not self.seen and isinstance(out, torch.Tensor) and out.is_floating_point() \
                    and batch in out.shape and vocab in out.shape and any(t.is_floating_point() for t in ins):
                self.seen = f"{func.__name__.split('.')[0]} made a tensor of shape {tuple(out.shape)}"
            return out

    return FullLogits()


def _vocab_case(exercise, vocab_parallel_step, vocabs, batch, features):
    out = []
    for vocab in vocabs:
        g = torch.Generator().manual_seed(1800 + vocab)
        h = torch.rand(batch, features, generator=g).to(device())
        weight = (torch.randn(vocab, features, generator=g) * 0.5).to(device())
        y = (torch.arange(batch) % vocab).to(device())
        watch = _logit_watch(batch, vocab)
        with watch:
            (loss, grad), record = watched_call(exercise, vocab_parallel_step, (h, weight.clone(), y),
                                                forbid=everything_but("all_reduce"),
                                                why="a vocabulary split over tensor-parallel ranks")
        # again, with the rows this rank does not own (no gradient from it) set to NaN here: a rank that reads them
        # returns NaN
        poisoned = weight.clone()
        poisoned[grad.detach().abs().sum(1) == 0] = float("nan")
        (loss2, grad2), _ = watched_call(exercise, vocab_parallel_step, (h, poisoned, y),
                                         forbid=everything_but("all_reduce"),
                                         why="a vocabulary split over tensor-parallel ranks")
        out.append((vocab, float(loss), grad.detach().cpu(), watch.seen, record, float(loss2), grad2.detach().cpu()))
    return out


def _vocab_reference(vocab, batch, features):
    g = torch.Generator().manual_seed(1800 + vocab)
    h = torch.rand(batch, features, generator=g)
    weight = (torch.randn(vocab, features, generator=g) * 0.5).requires_grad_()
    y = torch.arange(batch) % vocab
    loss = nn.functional.cross_entropy(h @ weight.T, y)
    loss.backward()
    return loss.detach().item(), weight.grad, float((h @ weight.T).detach().abs().max())


def check_vocab_parallel(vocab_parallel_step, exercise: str = "Exercise 18.6") -> None:
    """`vocab_parallel_step(h, W, y)` -> (loss, grad_W) on each tensor-parallel rank: the cross-entropy of logits
    h @ W.T whose vocabulary rows are split over the ranks, and this rank's share of dL/dW (zero on rows it does not
    own). For vocabularies the world size does not divide: each row owned by one rank, loss and gradient exact, no
    batch x vocabulary tensor on any rank, and the same results when the rows a rank does not own are NaN there."""
    hint = ("List which vocabulary rows each rank owns for 10 rows on 4 ranks. Does every row have an owner, and what "
            "happens to the loss of a sample whose label is a row nobody owns?")
    vocabs, batch, features = (10, 11), 12, 8
    for world in (3, 4):
        vals = launch_checked(exercise, _vocab_case, world,
                              args=(exercise, vocab_parallel_step, vocabs, batch, features), hint=hint,
                              what=f"{world} ranks")
        for k, vocab in enumerate(vocabs):
            ref_loss, ref_grad, biggest = _vocab_reference(vocab, batch, features)
            # float32: sums over the vocabulary and the batch in another order (max, exp-sum, mean)
            tol = tolerance.sum_atol(batch * vocab, batch * vocab * max(1.0, biggest))
            owners = torch.zeros(vocab, dtype=torch.long)
            total = torch.zeros_like(ref_grad)
            for rank, v in enumerate(vals):
                _, loss, grad, full, record, _, _ = v[k]
                if full:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: vocabulary {vocab} on {world} ranks: rank {rank} computed logits for all {vocab} "
                        f"rows ({full}, batch {batch} x vocabulary {vocab}); a tensor-parallel rank computes only its "
                        "own rows' logits.", hint))
                if not summary(record)["collectives"]:
                    raise ExerciseFailed(with_hint(f"{exercise}: vocabulary {vocab} on {world} ranks: rank {rank} "
                                                   "called no collective, so it cannot know the other rows.", hint))
                if abs(loss - ref_loss) > tol:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: vocabulary {vocab} on {world} ranks: rank {rank}'s loss is {loss:.5f}, the "
                        f"single-process loss {ref_loss:.5f} (float32 summation order allows {tol:.1g}).", hint))
                if grad.shape != ref_grad.shape:
                    raise ExerciseFailed(with_hint(f"{exercise}: rank {rank} returned a gradient of shape "
                                                   f"{tuple(grad.shape)}; W is {tuple(ref_grad.shape)}.", hint))
                owners += (grad.abs().sum(1) > 0).long()
                total += grad
            if (owners != 1).any():
                rows = {int(r): int(owners[r]) for r in torch.nonzero(owners != 1).flatten()}
                raise ExerciseFailed(with_hint(
                    f"{exercise}: vocabulary {vocab} on {world} ranks: rows with a gradient on other than exactly one "
                    f"rank, as row: ranks: {rows}.", hint))
            bad = tolerance.max_diff(total, ref_grad)
            if bad > tol:
                raise ExerciseFailed(with_hint(
                    f"{exercise}: vocabulary {vocab} on {world} ranks: the ranks' gradients together differ from "
                    f"dL/dW by up to {bad:.3g} (float32 summation order allows {tol:.1g}).", hint))
            for rank, v in enumerate(vals):
                _, loss, grad, _, _, loss2, grad2 = v[k]
                if not (math.isfinite(loss2) and bool(grad2.isfinite().all())) or abs(loss2 - loss) > tol \
                        or tolerance.max_diff(grad2, grad) > tol:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: vocabulary {vocab} on {world} ranks: run again with the rows each rank does not "
                        f"own (those it returned no gradient for) set to NaN on that rank, rank {rank}'s loss came out "
                        f"{loss2:.5g} instead of {loss:.5g}: some rank read rows of W it does not own.", hint))
    return passed(exercise, "vocabularies of 10 and 11 rows on 3 and 4 ranks: every row owned by one rank, loss and "
                            "dL/dW equal to the single-process ones, no rank computing the whole vocabulary")


# ------------------------------------------------------------------------------------------- 18.7 1F1B deadlock
def pipeline_stages():
    """The two stages the hunt's pipeline trains: 64 -> 32 with ReLU on rank 0, 32 -> 10 on rank 1."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(64, 32), nn.ReLU()), nn.Linear(32, 10)]


def _pipe_case(exercise, pipeline_step, micro, batch):
    rank = dist.get_rank()
    out = []
    for n_micro in micro:
        stage = pipeline_stages()[rank].to(device())
        order = []                                   # the stage's forwards and backwards, in the order they ran
        stage.register_forward_hook(lambda *_: order.append("F"))
        next(stage.parameters()).register_hook(lambda g: order.append("B"))   # once per backward through the stage
        x, y = _dev(*_secret_batch(0, n_micro, n=batch))
        _, record = watched_call(exercise, pipeline_step, (stage, x if rank == 0 else None, y if rank == 1 else None,
                                                          n_micro),
                                 forbid=everything_but("send_recv"), why="a pipeline's point-to-point schedule")
        grads = [None if p.grad is None else p.grad.cpu() for p in stage.parameters()]
        out.append((n_micro, grads, summary(record), "".join(order)))
    return out


def check_pipeline_step(pipeline_step, exercise: str = "Exercise 18.7") -> None:
    """`pipeline_step(stage, x, y, n_micro)`: one 1F1B step of the two-stage pipeline (x on rank 0, y on rank 1,
    None elsewhere), leaving the micro-batch gradients in the stage's .grad. Run under the NCCL rules with 1, 2 and 4
    micro-batches; each stage must run 1F1B (stage 0: one warm-up forward, then a forward and a backward in turn, then
    the last backward; stage 1: a forward and a backward in turn), send one message per micro-batch (activations or
    input gradient, each once), and leave the gradients of one process on the batch."""
    hint = ("Write down, for each stage, the order of its sends and receives for two micro-batches. On NCCL each "
            "waits for its peer's matching call: which stage waits for which, and can both wait at once?")
    micro, batch = (1, 2, 4), 8
    try:
        vals = run(_pipe_case, 2, args=(exercise, pipeline_step, micro, batch), timeout=20, output="none",
                   nccl_rules=learner_rules("auto")).values
    except RankFailed as exc:
        raise explain(exercise, exc, "2 stages and 1, 2, 4 micro-batches", hint) from None
    full = nn.Sequential(*pipeline_stages())
    act_bytes = batch * 32 * 4
    for k, n_micro in enumerate(micro):
        full.zero_grad()
        x, y = _secret_batch(0, n_micro, n=batch)
        nn.functional.cross_entropy(full(x), y).backward()
        want = [[p.grad for p in full[0].parameters()], [p.grad for p in full[1].parameters()]]
        tol = tolerance.grad_atol(batch, 64)
        for rank in (0, 1):
            _, grads, traffic, order = vals[rank][k]
            sent = "activations" if rank == 0 else "input gradient"
            if (traffic["messages_sent"], traffic["messages_recv"]) != (n_micro, n_micro):
                raise ExerciseFailed(with_hint(
                    f"{exercise}: {n_micro} micro-batches: stage {rank} sent {traffic['messages_sent']} and received "
                    f"{traffic['messages_recv']} messages; a step of {n_micro} micro-batches sends each micro-batch's "
                    f"{sent} as one message and receives one per micro-batch.", hint))
            if traffic["bytes_sent"] != act_bytes:
                raise ExerciseFailed(with_hint(
                    f"{exercise}: {n_micro} micro-batches: stage {rank} sent {traffic['bytes_sent']} bytes; one step "
                    f"sends each micro-batch's {sent} once, {act_bytes} bytes in all.", hint))
            one_f_one_b = "".join(kind for kind, _ in one_f_one_b_order(rank, 2, n_micro))
            if order != one_f_one_b:
                raise ExerciseFailed(with_hint(
                    f"{exercise}: {n_micro} micro-batches: stage {rank} ran its forwards (F) and backwards (B) in the "
                    f"order {' '.join(order) or 'none'}; 1F1B on 2 stages runs {' '.join(one_f_one_b)} there.", hint))
            for g, w in zip(grads, want[rank]):
                bad = float("inf") if g is None else tolerance.max_diff(g, w)
                if bad > tol:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {n_micro} micro-batches: stage {rank}'s gradients differ from one process's on "
                        f"the whole batch by up to {bad:.3g} (float32 summation order allows {tol:.1g}).", hint))
    return passed(exercise, "2 stages under the NCCL rules with 1, 2 and 4 micro-batches: no deadlock, 1F1B order on "
                            "both stages, one message per micro-batch each way, gradients equal one process's")
