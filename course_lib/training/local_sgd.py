"""Local SGD and DiLoCo: H steps alone, then one average (notebook 11b).

Local SGD (Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019): every rank takes H plain SGD steps
on its own shard, then the models are averaged with one all-reduce: 1/H of data parallel's messages. With H = 1 it
is data-parallel SGD (averaging the models after one step from equal weights = averaging the gradients).
DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", arXiv:2311.08105,
2023, Algorithm 1): the inner steps use AdamW, and instead of taking the average the ranks treat
delta = anchor - average (the "pseudo-gradient": how far H inner steps moved the shared weights) as a gradient for an
outer SGD with Nesterov momentum (learning rate 0.7, momentum 0.9 in the paper's experiments, as reproduced by
OpenDiLoCo, Jaghouar et al., arXiv:2407.07852, 2024). Optimizers are written by hand, as in adam.py: torch.optim's
first step costs about a second in every fresh rank process on a small CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from ..collectives import ring_all_reduce
from ..measure.emulated_link import emulate
from ..measure.traffic import Meter, metered
from . import tolerance
from .adam import adam_step
from .data import worker_batch
from .gossip import digits, evaluate, mean_atol
from .model import flat_params, make_mlp, set_flat_params
from .straggler import Straggler
from .threads import single_threaded
from .worker_loop import forward_backward, sgd_, simulate_workers, worker_steps

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9        # DiLoCo's outer Nesterov SGD
INNER_LR, WEIGHT_DECAY = 1e-3, 0.01        # AdamW for the inner steps (torch.optim.AdamW's default decay)


def nesterov_(anchor: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, lr: float = OUTER_LR,
              mu: float = OUTER_MOMENTUM) -> None:
    """One SGD step with Nesterov momentum in place, as torch.optim.SGD(momentum=mu, nesterov=True) computes it:
    buf <- mu buf + grad; anchor <- anchor - lr (grad + mu buf)."""
    buf.mul_(mu).add_(grad)
    anchor.sub_(lr * (grad + mu * buf))


def adamw_(w, g, m, v, t: int, lr: float = INNER_LR, weight_decay: float = WEIGHT_DECAY) -> None:
    """AdamW (Loshchilov & Hutter, ICLR 2019): decay the weights by lr*wd, then the Adam step (torch's order)."""
    w.mul_(1 - lr * weight_decay)
    adam_step(w, g, m, v, t, lr)


def diloco_outer_step(flat: torch.Tensor, anchor: torch.Tensor, buf: torch.Tensor, all_reduce=ring_all_reduce,
                      lr: float = OUTER_LR, mu: float = OUTER_MOMENTUM) -> None:
    """DiLoCo's outer step on every rank: average the pseudo-gradients anchor - flat with ONE all-reduce, take a
    Nesterov step on the anchor, and start the next H inner steps from it (flat <- anchor)."""
    delta = anchor - flat
    all_reduce(delta)
    delta /= dist.get_world_size()
    nesterov_(anchor, delta, buf, lr, mu)
    flat.copy_(anchor)


def _all_reduce(name: str):
    if name not in ("ring", "torch"):
        raise ValueError(f"all_reduce must be 'ring' (the course's, point-to-point: counted and emulated) or "
                         f"'torch', got {name!r}")
    return ring_all_reduce if name == "ring" else dist.all_reduce


def local_sgd_train(H: int = 4, steps: int = 16, batch_size: int = 32, lr: float = 0.1, hidden: int = 256,
                    seed: int = 0, outer: str | None = None, inner_lr: float = INNER_LR, link=None,
                    all_reduce: str = "ring", straggler=None, eval_every: int = 0, outer_step=None,
                    dtype: torch.dtype = torch.float32, inner: str | None = None, compute_s: float = 0.0,
                    by_label: bool = False) -> dict:
    """Run on every rank: local SGD (outer=None: H SGD steps, then average the models) or DiLoCo
    (outer="nesterov": H AdamW steps, then diloco_outer_step). A sync happens after steps H, 2H, ...
    inner="adamw" with outer=None: local SGD's plain average with DiLoCo's AdamW inner steps (notebook 11b's control).

    eval_every > 0: at each sync whose step is a multiple of it, rank 0 records (step, bytes sent so far, training
    seconds so far, loss and accuracy on all digits); evaluation time is left out of the seconds. `compute_s`: a fixed
    emulated compute per step (on the link's virtual clock); `straggler`: (rank, factor[, compute_s]) for
    straggler.Straggler. `outer_step(flat, anchor, momentum)` replaces diloco_outer_step
    (exercise 11b.1); by_label: shards of a few classes each.
    dtype=torch.float64 for comparisons with `simulate` that float32 cannot decide (AdamW:
    diloco_atol). Returns this rank's final flat parameters, per-step losses, seconds, bytes (sent, received),
    compute seconds, and those evaluations.
    """
    if H < 1 or outer not in (None, "nesterov") or inner not in (None, "sgd", "adamw"):
        raise ValueError(f"need H >= 1, outer None (local SGD) or 'nesterov' (DiLoCo), inner None, 'sgd' or 'adamw'; "
                         f"got H={H}, outer={outer!r}, inner={inner!r}")
    reduce = _all_reduce(all_reduce)
    adamw = outer is not None if inner is None else inner == "adamw"
    rank, p = dist.get_rank(), dist.get_world_size()
    model = make_mlp(hidden, seed, dtype).to(device())
    slow = Straggler(model, *(straggler or (-1, 1.0, compute_s)))
    params = list(model.parameters())
    m, v = [torch.zeros_like(q) for q in params], [torch.zeros_like(q) for q in params]
    anchor = flat_params(model)
    buf = torch.zeros_like(anchor)

    def inner_step_then_sync(step: int):
        if adamw:
            with torch.no_grad():
                for q, mq, vq in zip(params, m, v):
                    adamw_(q, q.grad, mq, vq, step + 1, inner_lr)
        else:
            sgd_(params, lr)
        if (step + 1) % H == 0:
            flat = flat_params(model)
            if outer is None:
                reduce(flat)                          # the average of the models, every H steps
                flat /= p
            elif outer_step is not None:
                outer_step(flat, anchor, buf)
            else:
                diloco_outer_step(flat, anchor, buf, reduce)
            set_flat_params(model, flat)

    (x, y), meter, evals, trained = digits(), Meter(), [], 0.0

    def my_batch(step: int):          # by_label: this rank's shard holds a few classes only
        return worker_batch(x, y, rank, p, batch_size, step, seed, by_label)

    def evaluate_at_sync(step: int, seconds: float):   # after the step is timed: evaluation time is left out
        nonlocal trained
        trained += seconds
        if eval_every and rank == 0 and (step + 1) % H == 0 and (step + 1) % eval_every == 0:
            evals.append((step + 1, meter.sent, trained, *evaluate(model)))   # all ranks hold this model

    with emulate(link), metered(meter):
        losses, step_s = worker_steps(steps, my_batch, lambda xb, yb: forward_backward(model, xb, yb),
                                      inner_step_then_sync, meter, after_step=evaluate_at_sync)
    final_loss, acc = evaluate(model)
    return {"params": flat_params(model).cpu(), "losses": losses, "step_s": step_s, "traffic": meter.steps,
            "compute_s": slow.compute_s, "evals": evals, "final_loss": final_loss, "accuracy": acc,
            "model_bytes": anchor.numel() * anchor.element_size()}


@single_threaded
def simulate(n_workers: int, H: int, steps: int, batch_size: int = 32, lr: float = 0.1, hidden: int = 256,
             seed: int = 0, outer: str | None = None, inner_lr: float = INNER_LR, outer_step=None,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One process playing all n workers in turn (each with its own model and AdamW state, its own shard): the
    weights local SGD or DiLoCo must end with, without any communication. `outer_step(flats, anchor, buf)` may
    replace the outer update (checkers use it to reproduce a wrong variant); returns the final flat parameters."""
    x, y = digits()
    models = [make_mlp(hidden, seed, dtype) for _ in range(n_workers)]
    states = [([torch.zeros_like(q) for q in mdl.parameters()], [torch.zeros_like(q) for q in mdl.parameters()])
              for mdl in models]
    anchor = flat_params(models[0])
    buf = torch.zeros_like(anchor)

    def inner_step(step: int, w: int, mdl: nn.Module):
        if outer is None:
            sgd_(mdl.parameters(), lr)
            return
        m, v = states[w]
        with torch.no_grad():
            for q, mq, vq in zip(mdl.parameters(), m, v):
                adamw_(q, q.grad, mq, vq, step + 1, inner_lr)

    def sync(step: int):
        if (step + 1) % H:
            return
        flats = [flat_params(mdl) for mdl in models]
        if outer is None:
            new = torch.stack(flats).sum(0) / n_workers
        elif outer_step is not None:
            new = outer_step(flats, anchor, buf)
        else:
            nesterov_(anchor, anchor - torch.stack(flats).sum(0) / n_workers, buf)
            new = anchor.clone()
        for mdl in models:
            set_flat_params(mdl, new.clone())   # a copy each: the parameters become views of what is set

    simulate_workers(lambda w: models[w], n_workers, steps, batch_size, seed, (x.to(dtype), y), inner_step, sync)
    return flat_params(models[0])


def diloco_atol(n_workers: int, H: int, steps: int, batch_size: int = 32, hidden: int = 256,
                dtype: torch.dtype = torch.float64, lr: float = OUTER_LR, mu: float = OUTER_MOMENTUM,
                inner_lr: float = INNER_LR) -> float:
    """How far DiLoCo's weights may end from `simulate`'s through rounding alone, to first order (as tolerance.py).
    Inner AdamW steps: tolerance.adam_atol's per-step bound, plus the decay's rounding (2u·WEIGHT; the
    decay itself only shrinks a difference). Outer step: the pseudo-gradient anchor - mean(flat) differs by both
    runs' anchor and flat differences plus the mean of n pseudo-gradients (each below 2·WEIGHT) taken in another
    order (mean_atol); momentum keeps mu times its old difference plus that; the anchor moves lr·(g + mu·buf).
    In float32 the Adam term is Adam's whole step (ε = 1e-8 divides the rounding): compare DiLoCo in float64."""
    u, w = tolerance.unit_roundoff(dtype), tolerance.WEIGHT
    anchor = buf = 0.0
    for start in range(0, steps - steps % H, H):
        inner = (tolerance.adam_atol(start + H, inner_lr, batch_size, hidden, dtype)
                 - tolerance.adam_atol(start, inner_lr, batch_size, hidden, dtype) + H * 2 * u * w)
        flat = anchor + inner
        g = anchor + flat + mean_atol(n_workers, 2 * w, dtype) + 2 * u * 2 * w
        buf = mu * buf + g + 2 * u * 2 * w / (1 - mu)
        anchor = anchor + lr * (g + mu * buf) + 2 * u * w
    return anchor + tolerance.adam_atol(steps, inner_lr, batch_size, hidden, dtype) - tolerance.adam_atol(
        steps - steps % H, inner_lr, batch_size, hidden, dtype)
