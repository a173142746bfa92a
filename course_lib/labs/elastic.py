"""Elastic restart lab: train, checkpoint with torch.distributed.checkpoint, lose a rank, resume (notebook 16).

    torchrun --nproc-per-node=2 --max-restarts=3 -m course_lib.labs.elastic --ckpt-dir ckpt --out weights.pt \\
        --kill-rank 1 --kill-step 7

Rank --kill-rank SIGKILLs itself once at --kill-step (a marker file makes it once, as PyTorch's own elastic tests
kill workers); torchrun sees the dead worker, stops the others and starts them all again; every rank then loads
the last COMPLETE checkpoint and replays the steps after it. Data depend only on (step, rank), so the final weights
equal an uninterrupted run's of the same job bit for bit (the same arithmetic in the same order on the same
device), and the one-process reference to reference_atol (float32 summation order, another device's kernels).
Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see group.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..training.tolerance import sgd_atol
from .group import join, leave, say

LR, MOMENTUM, BATCH, WIDTH = 0.05, 0.9, 32, 16
# One sample's gradient entry here reaches 11 in the first 12 steps (MSE on targets up to about 10): bound it by 20.
GRAD = 20.0


def make_model(dev: str | torch.device = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every rank starts from the same weights, as DDP's first broadcast would make them
    model = torch.nn.Sequential(torch.nn.Linear(4, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1)).to(dev)
    # Momentum is optimizer state: a checkpoint without it would not resume the same run.
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's data for this step, the same whenever the step is (re)played."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(BATCH, 4, generator=g)
    return x, (x[:, :1] * x[:, 1:2] + x[:, 2:3].sin())  # a small smooth target


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoint folders that were written to the end: DCP writes `.metadata` last, after every rank's data."""
    return sorted(p for p in ckpt_dir.glob("step_*") if (p / ".metadata").exists())


def train(steps: int, every: int, ckpt_dir: Path, kill_rank: int = -1, kill_step: int = -1,
          dev: str | torch.device = "cpu") -> dict:
    # DCP is imported here, not at the top: notebook 17 imports reference() from this module and never saves, and
    # DCP brings some 700 modules (DTensor, sympy): about 0.7 s of CPU to import on a 2-core machine.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = make_model(dev)
    # TORCHELASTIC_RESTART_COUNT counts this node's agent's restarts: a node restarted only because another node
    # failed may still say 0, so "resumed_from" is the sign that a restart happened.
    start, report = 0, {"restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    done = complete_checkpoints(ckpt_dir)
    if done:  # resume: load in place into the same structure, then hand it back to model and optimizer
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=done[-1])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"]) + 1
        report["resumed_from"] = done[-1].name
    marker = ckpt_dir / "killed_once"
    for step in range(start, steps):
        if rank == kill_rank and step == kill_step and not marker.exists():
            marker.write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no goodbye: as a lost GPU or node looks
        x, y = (t.to(dev) for t in batch(step, rank))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():  # data parallel by hand: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if step == start and start > 0 and marker.exists():  # first step after resuming from a kill
            report["recover_s"] = time.time() - float(marker.read_text())
        if (step + 1) % every == 0 or step == steps - 1:
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "step": torch.tensor(step)}
            dcp.save(state, checkpoint_id=ckpt_dir / f"step_{step:05d}")  # a collective: every rank calls it
        if rank == 0:
            say(f"step {step} loss {loss.item():.5f}")
    report["weights"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return report


def reference(steps: int, world: int, schedule=None) -> dict[str, torch.Tensor]:
    """The same training in one process, never interrupted: each rank's gradient computed in turn, then averaged
    (``schedule(opt, step)``, when given, runs before each step: a checker's learning-rate changes)."""
    model, opt = make_model()
    for step in range(steps):
        if schedule is not None:
            schedule(opt, step)
        grads = []
        for rank in range(world):
            opt.zero_grad()
            x, y = batch(step, rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = grads[0][i]
            for g in grads[1:]:
                total = total + g[i]  # the order all_reduce adds in for 2 ranks; exact for any order at 2
            p.grad = total / world
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_atol(steps: int, world: int) -> float:
    """How far a run may end from reference(): float32 gradient sums in another order (all-reduce, another CPU's or
    a GPU's kernels), carried through momentum SGD (training/tolerance.py). A lost momentum or a step not replayed
    moves the weights by about 0.1, a hundred times more."""
    return sgd_atol(steps, LR, world * BATCH, WIDTH, momentum=MOMENTUM, grad=GRAD)


@record  # a failing rank's traceback reaches torchrun's final report
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m course_lib.labs.elastic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ckpt-every", type=int, default=4, help="save a checkpoint every K steps (default 4)")
    ap.add_argument("--ckpt-dir", required=True, help="checkpoints go here (shared storage when multi-node)")
    ap.add_argument("--out", required=True, help="rank 0 writes the final weights and a report here (torch.save)")
    ap.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself once (default: none)")
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=30.0, help="process-group timeout in seconds")
    args = ap.parse_args(argv)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    env, _, dev = join(args.timeout)
    try:
        report = train(args.steps, args.ckpt_every, ckpt_dir, args.kill_rank, args.kill_step, dev)
        if env.rank == 0:
            torch.save(report, args.out)
            say("report " + json.dumps({k: v for k, v in report.items() if k != "weights"}))
    finally:
        leave()


if __name__ == "__main__":
    try:
        main()
    finally:
        # The worker is done: report saved and group left, or its error on the way to torchrun. Python's final
        # garbage collection would still walk every object of the 2,000 modules torch, DCP and torch.optim loaded
        # (about 0.65 s of CPU per worker on a 2-core machine, paid again after every restart); frozen objects are
        # skipped, and the operating system frees the memory either way.
        gc.freeze()
