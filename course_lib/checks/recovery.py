"""Checker of exercise 16.1 (notebook 16): ``resume(model, opt, ckpt_dir)``, which a restarted training script calls
on every rank before its first step, loads the newest COMPLETE checkpoint and returns the step to start at.

The learner's function runs on 2 real ranks inside notebook 16's training loop (data parallel by hand, a DCP
checkpoint every EVERY steps into ``step_NNNNN`` folders, the model and data of course_lib.labs.elastic):

1. on an empty folder: a fresh start, 0, the model left as built;
2. on the folder of a first attempt whose rank 1 was SIGKILLed in the middle of saving step TORN (so the folders
   of the earlier saves are complete and the last has no ``.metadata``): the restart must go on after the newest
   complete checkpoint, with the learning rate the run had lowered at step DECAY, and end with the one-process
   reference's weights (to labs.elastic's reference_atol: float32 summation order; a lost momentum moves them
   about a hundred times more);
3. on the finished run's folder, with a fresh model and optimizer: they must get its weights, momentum and learning
   rate exactly.

Starting over from step 0 also ends with the right weights (a batch depends only on (step, rank)), so the step
returned is checked, not only the weights; taking the second-newest folder is right in case 2 and wrong in case 3.
The learning rate, lowered at step DECAY as a schedule would, is why set_state_dict is needed: dcp.load fills the
tensors get_state_dict returned in place, and those are the live weights and momentum, but a plain number such as
the lr reaches the optimizer only through set_state_dict. On an empty folder, get_state_dict (which gives a fresh
optimizer zero momentum buffers) is allowed: SGD's next step makes of a zero buffer exactly what it makes of none.
While the learner's code runs, the lab's own search for complete checkpoints is switched off.
"""

from __future__ import annotations

import operator
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from ..labs.elastic import LR, batch, make_model, reference, reference_atol
from ..runtime.devices import device
from ..runtime.forkserver import get_server
from ..runtime.launch import run
from ..runtime.results import RankFailed
from ..training.tolerance import max_diff
from .core import CaseFailed, ExerciseFailed, explain, learner_rules, passed, with_hint

STEPS, EVERY, TORN, WORLD = 10, 2, 5, 2   # saves after steps 1, 3, 5, ...; rank 1 dies while saving step 5
DONE = TORN - EVERY                       # the newest complete checkpoint the killed run left: step 3
DECAY = 2                                 # the learning rate is halved before step 2, as a schedule would
SHORTCUTS = ("course_lib.labs.elastic.complete_checkpoints",)
HINT = ("Which folders are complete: what does dcp.save write last, once every rank's data is on disk? "
        "dcp.load fills in place a state dict of the right structure: get one from get_state_dict(model, opt) with "
        "the keys save_checkpoint used, and hand what it loaded back with set_state_dict. The checkpoint of step s "
        "holds the state after step s.")


def _folder(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step_{step:05d}"


class _DiesWhileSaving(dcp.FileSystemWriter):
    """Writes this rank's file, then SIGKILLs the rank before the coordinator can write .metadata."""

    def write_data(self, plan, planner):
        import os
        import signal

        written = super().write_data(plan, planner)
        written.wait()
        os.kill(os.getpid(), signal.SIGKILL)


def _save(model, opt, step: int, ckpt_dir: Path, writer=None) -> None:
    """notebook 16's save_checkpoint: model, optimizer and step, one folder per step."""
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step)}, checkpoint_id=_folder(ckpt_dir, step),
             storage_writer=writer)


def _schedule(opt, step: int) -> None:
    if step == DECAY:  # once, as a scheduler's step would: a restart after it must get the lower lr from the checkpoint
        for group in opt.param_groups:
            group["lr"] = LR / 2


def _train_step(model, opt, step: int) -> None:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    _schedule(opt, step)
    x, y = (t.to(dev) for t in batch(step, rank))
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()


def _first_attempt(ckpt_dir: Path) -> None:
    """On every rank: train from step 0, saving every EVERY steps; rank 1 dies inside the save of step TORN."""
    model, opt = make_model(device())
    for step in range(STEPS):
        _train_step(model, opt, step)
        if (step + 1) % EVERY == 0:
            dies = dist.get_rank() == 1 and step == TORN
            _save(model, opt, step, ckpt_dir, _DiesWhileSaving(_folder(ckpt_dir, step)) if dies else None)


def _reference(steps: int, world: int) -> dict[str, torch.Tensor]:
    """labs.elastic.reference with this checker's schedule: one process, never interrupted."""
    return reference(steps, world, schedule=_schedule)


def _state(model, opt) -> tuple[dict, list, list]:
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    momentum = [opt.state.get(p, {}).get("momentum_buffer") for p in model.parameters()]
    # a zero buffer (what get_state_dict gives a fresh optimizer) trains exactly as no buffer: buf*0.9 + grad == grad
    momentum = [None if m is None or not m.any() else m.detach().cpu().clone() for m in momentum]
    return weights, momentum, [float(g["lr"]) for g in opt.param_groups]


def _differs(a: tuple, b: tuple) -> str:
    """'' when two states are equal bit for bit, else what differs: 'weights', 'momentum' or 'learning rate'."""
    if a[0].keys() != b[0].keys() or any(not torch.equal(a[0][k], b[0][k]) for k in a[0]):
        return "weights"
    if any((x is None) != (y is None) or (x is not None and not torch.equal(x, y)) for x, y in zip(a[1], b[1])):
        return "momentum"
    if a[2] != b[2]:
        return "learning rate"
    return ""


def _call(exercise: str, resume, model, opt, ckpt_dir: Path, case: str):
    """The learner's resume with the shortcuts off; its step as an int, or a repr of what it returned instead."""
    from .switch_off import SwitchedOff, switched_off

    try:
        with switched_off(exercise, why="finding and loading the newest complete checkpoint", library=SHORTCUTS):
            got = resume(model, opt, ckpt_dir)
    except (NotImplementedError, SwitchedOff, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:   # DCP's CheckpointException is a BaseException
        raise CaseFailed(f"with {case}: {type(exc).__name__}: {exc}").with_traceback(exc.__traceback__) from None
    try:
        return operator.index(got)            # 4, np.int64(4) and a 0-d integer tensor are all step 4
    except TypeError:
        return repr(got)


def _agreed(start) -> bool:
    """Every rank returned the same step (else their loops would call different collectives and hang)."""
    mine = torch.tensor([start if isinstance(start, int) else -1] * 2, device=device())
    mine[1] = -mine[1]
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return int(mine[0]) == -int(mine[1])


def _restart(exercise: str, resume, ckpt_dir: Path, empty: Path) -> dict:
    """On every rank: the learner's resume on an empty folder, then the restart of the killed run, then a fresh
    model and optimizer loaded from the finished run."""
    out = {}
    model, opt = make_model(device())
    before = _state(model, opt)
    out["empty"] = _call(exercise, resume, model, opt, empty, "an empty folder (no checkpoint yet)")
    out["touched"] = _differs(before, _state(model, opt))
    model, opt = make_model(device())
    start = out["start"] = _call(exercise, resume, model, opt, ckpt_dir, "the folder the killed run left")
    if not _agreed(start) or not (isinstance(start, int) and 0 <= start <= STEPS):
        out["agreed"] = False
        return out
    out["agreed"] = True
    _, momentum, lrs = _state(model, opt)
    out["lr"], out["momentum_loaded"] = lrs[0], start > 0 and all(m is not None for m in momentum)
    for step in range(start, STEPS):
        _train_step(model, opt, step)
        if (step + 1) % EVERY == 0:
            _save(model, opt, step, ckpt_dir)
    final = _state(model, opt)
    out["weights"] = final[0]
    fresh, fresh_opt = make_model(device())
    out["end"] = _call(exercise, resume, fresh, fresh_opt, ckpt_dir, "the finished run's folder")
    out["restored"] = _differs(final, _state(fresh, fresh_opt))
    return out


def _listing(ckpt_dir: Path) -> str:
    folders = sorted(ckpt_dir.glob("step_*"))
    done = [p.name for p in folders if (p / ".metadata").exists()]
    torn = [p.name for p in folders if not (p / ".metadata").exists()]
    return f"{', '.join(done)} (each with .metadata) and {', '.join(torn)} (rank 1 died while saving it)"


def _judge(exercise: str, out: dict, on_disk: str) -> None:
    """Raises ExerciseFailed on the first thing wrong."""
    def fail(text):
        raise ExerciseFailed(with_hint(f"{exercise}: {text}", HINT))

    if out["empty"] != 0:
        fail(f"on an empty folder (no checkpoint yet) your resume returned {out['empty']}: a fresh job starts at 0.")
    if out["touched"]:
        fail(f"on an empty folder your resume changed the {out['touched']}: with nothing to load, leave the "
             "model and optimizer as make_model built them.")
    start = out["start"]
    if not isinstance(start, int):
        fail(f"your resume returned {start}, not a step: return an int.")
    if not out["agreed"]:
        fail(f"the ranks' resume returned different steps (or one outside 0-{STEPS}); every rank must start at the "
             "same step, or their collectives no longer pair.")
    if start != DONE + 1 or out["end"] != STEPS:
        known = f"On disk after rank 1 was SIGKILLed: {on_disk}."
        if start == 0:
            fail("the restart started over at step 0. Its weights would end right (a batch depends only on (step, "
                 f"rank)), but every step since the start ran again. {known} Load the newest complete checkpoint.")
        if start == DONE:
            fail(f"the restart began at step {start}, the step its checkpoint had already saved, so that step ran "
                 f"twice. {known} Return the step after it.")
        if start != DONE + 1:
            fail(f"the restart began at step {start}. {known} Which folder did your resume load, and which step "
                 "comes after it?")
        fail(f"the restart was right, but loading the finished run's folder (complete checkpoints of steps 1 to "
             f"{STEPS - 1}, every {EVERY}) your resume returned {out['end']}: does it always take the newest "
             "complete one?")
    if out["momentum_loaded"] and out["lr"] != LR / 2:
        fail(f"your resume loaded step_{DONE:05d}'s momentum, but left the optimizer's learning rate at {out['lr']:g}; "
             f"this run had halved it to {LR / 2:g} at step {DECAY}, as a schedule would, and the checkpoint holds it "
             "in the optimizer's param_groups. dcp.load fills the tensors in place (the live weights and momentum), "
             "but plain numbers such as the lr reach the optimizer only through set_state_dict.")
    ref, tol = _reference(STEPS, WORLD), reference_atol(STEPS, WORLD)
    worst = max(max_diff(out["weights"][k], ref[k]) for k in ref)
    if worst > tol:
        fail(f"the restart began at the right step, but the run ended {worst:.3g} away from the one-process, "
             f"uninterrupted reference (float32 summation order allows {tol:.1g}): did your resume restore the "
             "optimizer's momentum and learning rate as well as the weights?")
    if out["restored"]:
        fail(f"a fresh model and optimizer loaded from the finished run's folder did not get its {out['restored']} "
             "exactly: load the optimizer's state as well as the model's, and hand it back with set_state_dict.")


def check_resume(resume, exercise: str = "Exercise 16.1") -> None:
    """``resume(model, opt, ckpt_dir)`` on 2 real ranks: an empty folder, the restart after a kill in the middle of
    a save, and the finished run loaded into a fresh model (see the module's docstring)."""
    # this module's imports (DCP, and torch.distributed.tensor with it) would cost every rank of both launches half
    # a second or more on 2 cores; the rank server imports them once, as it does torch, and forks the ranks with them
    get_server(("course_lib.checks.recovery",))
    with tempfile.TemporaryDirectory() as tmp:
        job, empty = Path(tmp) / "job", Path(tmp) / "empty"
        job.mkdir()
        empty.mkdir()
        try:
            run(_first_attempt, WORLD, args=(job,), timeout=30, output="none")
            raise RuntimeError("the checker's first attempt should have lost rank 1")
        except RankFailed as exc:
            if exc.failure.kind != "signal" or exc.rank != 1:
                raise RuntimeError(f"the checker's first attempt failed another way:\n{exc}") from None
        on_disk = _listing(job)
        try:
            out = run(_restart, WORLD, args=(exercise, resume, job, empty), timeout=30, output="none",
                      nccl_rules=learner_rules("auto")).values
        except RankFailed as exc:
            if exc.failure.etype == "CaseFailed":
                case = exc.failure.message.split(":", 1)[0].removeprefix("with ")
                extra = (f" On disk: {on_disk}." if "killed" in case else "")
                raise ExerciseFailed(with_hint(f"{exercise}: your resume failed with {case}.{extra}\n\n{exc}",
                                               HINT)) from None
            raise explain(exercise, exc, f"{WORLD} ranks", HINT) from None
    _judge(exercise, out[0], on_disk)
    return passed(exercise, f"rank 1 died while saving step {TORN}; your resume skipped the torn step_{TORN:05d}, "
                            f"loaded step_{DONE:05d}, and the restart went on at step {DONE + 1} and ended with the "
                            f"one-process, uninterrupted run's weights (to {reference_atol(STEPS, WORLD):.0e}, what "
                            "float32 sums in another order allow); an empty folder gave 0, and a fresh model got the "
                            "finished run's weights, momentum and halved learning rate exactly")
