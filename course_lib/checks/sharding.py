"""Checkers for the exercises of notebook 12 (sharded data parallel: ZeRO and FSDP).

Each runs real ranks: the time a ZeRO-3 forward with prefetch really takes on the emulated link, and a ZeRO-1 update
written by the learner, trained in float64 against single-process Adam (Rajbhandari et al., SC'20, section 5.1).
The library's own answers (course_lib.training.prefetch's runs, course_lib.training.zero's steps) and every way to
start ranks are switched off while the learner's code runs, and its collectives are counted at the dispatcher
(watch.py).
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist
from torch import nn

from ..measure.c10d_ops import everything_but
from ..runtime.devices import device
from ..runtime.launch import run
from ..training.adam import adam_step
from ..training.data import combined_batch, load_digits, worker_batch
from ..training.model import flat_params, make_mlp
from ..training.prefetch import forward_times
from ..training.tolerance import GRAD, adam_atol, grad_atol, max_diff
from .core import ExerciseFailed, call_learner, launch_checked, passed, watched_call, with_hint

STEPS, BATCH, HIDDEN = 3, 16, 32     # hidden 32: 3466 parameters, a 10-row layer: uneven over 3 and 4 ranks
ZERO_ANSWERS = tuple(f"course_lib.training.zero.{f}" for f in ("zero1_step", "zero2_step", "zero3_step", "dp_step",
                                                               "reduce_scatter_mean", "_update_my_rows_and_gather"))


# Exercise 12.1: layers of equal width first (a rule right only for them passes there), then uneven ones, whose
# all-gathers and computes no longer pair up layer by layer
PREFETCH_LINK = "100 MbE"
PREFETCH_CASES = {
    2: [([96, 96, 96, 96], [0.004] * 4), ([32, 256, 64, 160], [0.006, 0.002, 0.010, 0.003])],
    3: [([96, 96, 96], [0.003] * 3), ([192, 48, 240, 96], [0.002, 0.008, 0.001, 0.005])],
}
PREFETCH_ANSWERS = tuple(f"course_lib.training.prefetch.{f}" for f in ("forward_times", "sharded_forward",
                                                                       "gather_seconds"))


def _prefetch_runs(cases, link):
    """Run on every rank: prefetch.forward_times for each (widths, compute seconds) case."""
    return [forward_times(widths, compute_s, link) for widths, compute_s in cases]


def check_prefetch_forward_s(prefetch_forward_s, exercise: str = "Exercise 12.1") -> None:
    """`prefetch_forward_s(gather_s, compute_s)` -> seconds of a ZeRO-3 forward with one layer of prefetch (layer
    i+1's all-gather posted just before layer i computes; the link carries one gather at a time). Compared with the
    forward the course's loop really took on 2 and 3 gloo ranks over an emulated link, each layer's all-gather
    seconds measured on that link, for layers of uneven widths and compute times."""
    hint = ("Follow the clock layer by layer: when can layer i start computing, and when is layer i+1's all-gather "
            "posted? Which gather travels during which layer's compute, and which one does nothing hide?")
    even_ok = None
    for p, cases in PREFETCH_CASES.items():
        runs = run(_prefetch_runs, p, args=(cases, PREFETCH_LINK), backend="gloo", output="none", timeout=60).values
        for i, ((widths, compute_s), measured) in enumerate(zip(cases, runs[0])):
            assert all(r[i]["prefetch"]["seconds"] == measured["prefetch"]["seconds"] for r in runs), "ranks differ"
            assert measured["prefetch"]["exact"], "the sharded forward lost the unsharded forward's output"
            gather_s, want = list(measured["gather_s"]), measured["prefetch"]["seconds"]
            got = call_learner(exercise, prefetch_forward_s, list(gather_s), list(compute_s), hint=hint,
                               library=PREFETCH_ANSWERS, why="predicting what prefetch hides")
            number = isinstance(got, numbers.Real) and not isinstance(got, bool)
            # the clock adds a few float64 seconds per layer, rounded to ~1e-18 s each: 1e-9 s is far above that
            ok = number and abs(got - want) <= 1e-9
            even = len(set(compute_s)) == 1 and len(set(widths)) == 1
            if even:
                even_ok = ok
            if not ok:
                ms = ", ".join(f"{t * 1e3:.3f}" for t in gather_s)
                said = f"{got * 1e3:.3f} ms" if number else repr(got)
                extra = (" Your rule gave the right time for layers of equal width; here they differ, so pair each "
                         "all-gather with the compute it really runs beside." if even_ok and not even else "")
                raise ExerciseFailed(with_hint(
                    f"{exercise}: {p} ranks, layers of {widths} rows, all-gathers of {ms} ms and compute of "
                    f"{', '.join(f'{c * 1e3:g}' for c in compute_s)} ms: you said {said}, the forward with prefetch "
                    f"took {want * 1e3:.3f} ms on the emulated link (without prefetch "
                    f"{measured['no_prefetch']['seconds'] * 1e3:.3f} ms).{extra}", hint))
    return passed(exercise, "your rule gives the time of a forward with prefetch on 2 and 3 ranks, for equal and "
                            "for uneven layers, to the nanosecond of the emulated clock")


WARM = 2    # steps of single-process Adam before the learner's: m and v start as shards of a state that is not zero
DTYPE = torch.float64   # as the notebook compares (its "Going deeper"): float32 Adam leaves no useful rounding bound
LR = 1e-3


def _single_adam_state(p: int, steps: int):
    """Single-process Adam on the combined batch of p workers (as train_single_adam), in DTYPE: flat params, m, v."""
    x, y = load_digits()
    model = make_mlp(HIDDEN, 0, DTYPE)
    params = list(model.parameters())
    m, v = [torch.zeros_like(q) for q in params], [torch.zeros_like(q) for q in params]
    for step in range(steps):
        xb, yb = combined_batch(x.to(DTYPE), y, p, BATCH, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        for q, mq, vq in zip(params, m, v):
            adam_step(q, q.grad, mq, vq, step + 1, LR)
    flat = [torch.cat([t.detach().reshape(-1) for t in ts]) for ts in (params, m, v)]
    return flat[0], flat[1], flat[2]


def _shard(flat: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    """Rank's slice of `flat` padded with zeros to a multiple of p."""
    c = -(-flat.numel() // p)
    padded = torch.zeros(p * c, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return padded[rank * c:(rank + 1) * c].clone()


def _train_with_learner_step(exercise, step_fn):
    """Run on every rank: WARM steps of single-process Adam, then STEPS steps of data parallel where the learner's
    step_fn does the whole update with m, v shards of ceil(Ψ/p) values, handed over holding this rank's slice of the
    warm state; returns (final flat params, collectives per step as (name, bytes), shard sizes after, m and v after,
    m and v before)."""
    rank, p, dev = dist.get_rank(), dist.get_world_size(), device()
    model = make_mlp(HIDDEN, 0, DTYPE).to(dev)
    params = list(model.parameters())
    warm, warm_m, warm_v = _single_adam_state(p, WARM)
    torch.nn.utils.vector_to_parameters(warm.to(dev), params)
    m, v = _shard(warm_m, p, rank).to(dev), _shard(warm_v, p, rank).to(dev)
    before = (m.cpu().clone(), v.cpu().clone())
    x, y = load_digits()
    calls = []
    for step in range(WARM, WARM + STEPS):
        xb, yb = worker_batch(x, y, rank, p, BATCH, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(xb.to(dev, DTYPE)), yb.to(dev)).backward()
        _, record = watched_call(exercise, step_fn, (params, m, v, step + 1, LR), library=ZERO_ANSWERS,
                                 forbid=everything_but("reduce_scatter_single", "all_gather_single"),
                                 why="replacing all-reduce by one reduce-scatter and one all-gather of a flat buffer")
        calls.append(sorted((name, nbytes) for name, nbytes, *_ in record["collectives"]))
        turned = sorted({str(q.dtype) for q in params if q.dtype != DTYPE})
        if turned:               # the next forward would fail inside torch; say why instead
            return None, calls, turned, None, None
    return flat_params(model).cpu(), calls, (m.numel(), v.numel()), (m.cpu(), v.cpu()), before


def check_zero1_flat_step(step_fn, exercise: str = "Exercise 12.2") -> None:
    """`step_fn(params, m, v, t, lr)`: reduce-scatter all gradients in one flat buffer, Adam on this rank's slice
    with its shard m, v (ceil(Ψ/p) values each), all-gather the slices into the parameters. Trained in float64 on 2
    and 3 real ranks from a warm start (m, v arrive holding this rank's slice of Adam's state after WARM steps,
    t > 1): weights must equal single-process Adam within what float64 rounding allows (tolerance.adam_atol), with
    exactly one reduce-scatter and one all-gather of the padded flat buffer a step, and m, v must end as this rank's
    slice of single-process Adam's state: an update that keeps a full state of its own elsewhere (plain data
    parallel under ZeRO-1's name) cannot know the warm state and fails."""
    hint = ("ZeRO-1 keeps a shard of the optimizer state on each rank. Which collective gives a rank the summed "
            "gradient of its own slice only, and which one brings the updated slices back to everyone? Mind the "
            "padding to a multiple of p, and make your buffers in m's dtype.")
    for p in (2, 3):
        vals = launch_checked(exercise, _train_with_learner_step, p, args=(exercise, step_fn), hint=hint,
                              what=f"{p} ranks")
        ref, ref_m, ref_v = _single_adam_state(p, WARM + STEPS)
        c = -(-ref.numel() // p)
        flat_bytes = p * c * ref.element_size()      # S of both collectives: the padded flat buffer, in float64
        # what float64 rounding allows after every step of this run (the warm ones too: the kernel and the ranks
        # may block their sums differently); m and v: a gradient entry's reordering bound (v: times 2·GRAD, d(g²))
        tol = adam_atol(WARM + STEPS, LR, p * BATCH, HIDDEN)
        g_tol = grad_atol(p * BATCH, HIDDEN, DTYPE)
        for r, (params, calls, sizes, after, before) in enumerate(vals):
            if params is None:
                raise ExerciseFailed(with_hint(
                    f"{exercise}: rank {r} of {p}: after your step the parameters are {', '.join(sizes)}, not "
                    f"{DTYPE}: torch.nn.utils.vector_to_parameters (or q.data = ...) makes each parameter a view of "
                    "the buffer you pass, in its dtype. Make every buffer in m's dtype (m.new_zeros, "
                    "torch.empty_like(m)), or copy into the parameters with q.copy_().", hint))
            (m, v), (m0, v0) = after, before
            if sizes != (c, c):
                raise ExerciseFailed(with_hint(f"{exercise}: rank {r} of {p}: m and v must stay this rank's shards "
                                               f"of ceil(Ψ/p) = {c} values, they have {sizes}.", hint))
            for step, made in enumerate(calls):
                if [name for name, _ in made] != ["all_gather_single", "reduce_scatter_single"]:
                    raise ExerciseFailed(with_hint(f"{exercise}: rank {r} ran {[n for n, _ in made]} in step "
                                                   f"{step + 1}; one flat buffer means one reduce-scatter and one "
                                                   "all-gather per step.", hint))
            if torch.equal(m, m0) and torch.equal(v, v0):
                raise ExerciseFailed(with_hint(f"{exercise}: rank {r} of {p}: m and v are what they were before your "
                                               f"{STEPS} steps: the update did not use this rank's shard of Adam's "
                                               "state.", hint))
            sent = {nbytes for made in calls for _, nbytes in made}
            if sent != {flat_bytes}:
                half = f" ({flat_bytes // 2} B: a float32 buffer)" if flat_bytes // 2 in sent else ""
                raise ExerciseFailed(with_hint(
                    f"{exercise}: rank {r} of {p}: your collectives moved buffers of {sorted(sent)} B{half}; the "
                    f"padded flat buffer is p·len(m) = {p * c} values of m's dtype ({m.dtype}), {flat_bytes} B. "
                    "Make every buffer in m's dtype (m.new_zeros, torch.empty_like(m)).", hint))
            bad = max_diff(params, ref)
            if bad > tol:
                raise ExerciseFailed(with_hint(f"{exercise}: with {p} ranks rank {r}'s weights differ from "
                                               f"single-process Adam by up to {bad:.3g} (float64 rounding allows "
                                               f"{tol:.1g}; the run started from {WARM} steps of Adam: m and v "
                                               "arrive holding this rank's slice of its state).", hint))
            if max_diff(m, _shard(ref_m, p, r)) > g_tol or max_diff(v, _shard(ref_v, p, r)) > 2 * GRAD * g_tol:
                raise ExerciseFailed(with_hint(f"{exercise}: rank {r} of {p}: the weights are right but m and v are "
                                               "not this rank's slice of Adam's state: was the update made with "
                                               "them?", hint))
    return passed(exercise, "weights equal single-process Adam on 2 and 3 ranks from a warm start (float64, within "
                            "what rounding allows), with one reduce-scatter and one all-gather of the flat buffer "
                            "per step, and m, v each rank's slice of Adam's state")
