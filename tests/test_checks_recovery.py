"""Exercise 16.1's checker (course_lib/checks/recovery.py) on real ranks: a resume written three ways passes (one
asks get_state_dict for the structure before it knows whether there is anything to load); the lab's own search for
complete checkpoints is refused (a); starting over, taking the second-newest folder, and dcp.load without
set_state_dict, which end with the right weights or momentum, are refused (b); a lost momentum, the torn folder, the
saved step itself and an empty folder that crashes are refused with a sentence that says which (c)."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from course_lib.checks.core import ExerciseFailed, NotAttempted
from course_lib.checks.recovery import check_resume


def _load(model, opt, folder):
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"]) + 1


def resume(model, opt, ckpt_dir):
    """The notebook's solution."""
    done = sorted(p for p in ckpt_dir.glob("step_*") if (p / ".metadata").exists())
    return _load(model, opt, done[-1]) if done else 0


def resume_by_name(model, opt, ckpt_dir):
    """(d) written differently: os.listdir, the step read from the folder's name, the newest by number."""
    steps = [int(name.split("_")[1]) for name in os.listdir(ckpt_dir)
             if os.path.exists(os.path.join(ckpt_dir, name, ".metadata"))]
    if not steps:
        return 0
    last = max(steps)
    _load(model, opt, Path(ckpt_dir) / f"step_{last:05d}")
    return last + 1


def structure_first(model, opt, ckpt_dir):
    """(d) get_state_dict before looking: on a fresh optimizer it makes zero momentum buffers, which train exactly
    as none (SGD: buf * 0.9 + grad == grad)."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": torch.tensor(-1)}
    done = sorted(p for p in ckpt_dir.glob("step_*") if (p / ".metadata").exists())
    if done:
        dcp.load(state, checkpoint_id=done[-1])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"]) + 1


def with_the_labs_search(model, opt, ckpt_dir):
    """(a) the lab's own complete_checkpoints."""
    from course_lib.labs.elastic import complete_checkpoints

    done = complete_checkpoints(ckpt_dir)
    return _load(model, opt, done[-1]) if done else 0


def start_over(model, opt, ckpt_dir):
    """(b) the final weights are right (a batch depends only on (step, rank)), but nothing was resumed."""
    return 0


def second_newest(model, opt, ckpt_dir):
    """(b) right after the kill (the newest folder is the torn one), wrong once the newest is complete."""
    folders = sorted(ckpt_dir.glob("step_*"))
    return _load(model, opt, folders[-2]) if len(folders) >= 2 else 0


def no_set_state_dict(model, opt, ckpt_dir):
    """(b) dcp.load alone fills the live weights and momentum in place; only the learning rate is not handed back."""
    done = sorted(p for p in ckpt_dir.glob("step_*") if (p / ".metadata").exists())
    if not done:
        return 0
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=done[-1])
    return int(state["step"]) + 1


def model_only(model, opt, ckpt_dir):
    """(c) the weights without the optimizer's momentum."""
    done = sorted(p for p in ckpt_dir.glob("step_*") if (p / ".metadata").exists())
    if not done:
        return 0
    state = {"model": model.state_dict(), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=done[-1])
    return int(state["step"]) + 1


def newest_folder(model, opt, ckpt_dir):
    """(c) the newest folder, complete or not."""
    folders = sorted(ckpt_dir.glob("step_*"))
    return _load(model, opt, folders[-1]) if folders else 0


def saved_step(model, opt, ckpt_dir):
    """(c) the step the checkpoint saved, which then runs twice."""
    done = sorted(p for p in ckpt_dir.glob("step_*") if (p / ".metadata").exists())
    return _load(model, opt, done[-1]) - 1 if done else 0


def crashes_when_empty(model, opt, ckpt_dir):
    """(c) no case for a fresh start."""
    done = sorted(p for p in ckpt_dir.glob("step_*") if (p / ".metadata").exists())
    return _load(model, opt, done[-1])


def stub(model, opt, ckpt_dir):
    raise NotImplementedError("Exercise 16.1: resume: write your solution here")


def test_a_resume_written_three_ways_passes(capsys):
    check_resume(resume)
    check_resume(resume_by_name)
    check_resume(structure_first)
    out = capsys.readouterr().out
    assert out.count("✓ Exercise 16.1 passed") == 3 and "loaded step_00003" in out


def test_the_labs_own_search_is_switched_off():
    with pytest.raises(ExerciseFailed, match=r"labs\.elastic\.complete_checkpoints \(it holds the answer\) is "
                                             r"switched off"):
        check_resume(with_the_labs_search)


@pytest.mark.parametrize("fn, says", [
    (start_over, r"started over at step 0\. Its weights would end right"),
    (second_newest, r"the restart was right, but loading the finished run's folder .* returned 8"),
    (no_set_state_dict, r"left the optimizer's learning rate at 0\.05; this run had halved it to 0\.025 .* "
                        r"only through set_state_dict"),
    (model_only, r"ended 0\.0\d+ away from the one-process, uninterrupted reference .* momentum"),
    (newest_folder, r"your resume failed with the folder the killed run left\. On disk: step_00001, step_00003 "
                    r"\(each with \.metadata\) and step_00005"),
    (saved_step, r"began at step 3, the step its checkpoint had already saved"),
    (crashes_when_empty, r"your resume failed with an empty folder \(no checkpoint yet\)"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_wrong_resumes_are_refused_with_what_went_wrong(fn, says):
    with pytest.raises(ExerciseFailed, match=says) as e:
        check_resume(fn)
    assert "Hint" in str(e.value)


def test_the_student_stub_is_not_attempted():
    with pytest.raises(NotAttempted, match=r"Exercise 16\.1: not attempted yet"):
        check_resume(stub)
