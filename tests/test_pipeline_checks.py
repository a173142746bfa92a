"""The checkers of notebook 14 pass the right method and reject the wrong one of the kind each exercise is about,
with a message that says what went wrong (the right solutions also run in the notebook itself, under nbval)."""

import math

import pytest
import torch
import torch.distributed as dist

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.pipeline import check_loss_scaling, check_min_microbatches, check_one_f_one_b


def _loop(p, target):
    m = 1
    while (p - 1) / (m + p - 1) > target:
        m += 1
    return m


def _closed_form(p, target):          # off by one where (p-1)(1-t)/t lands just above an integer in floats
    return max(1, math.ceil((p - 1) * (1 - target) / target))


def test_14_1_passes_the_bubble_and_rejects_a_float_closed_form(capsys):
    check_min_microbatches(_loop)
    assert "✓ Exercise 14.1" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match=r"p=4 stages, target bubble 0.2: you returned m=13, expected 12"):
        check_min_microbatches(_closed_form)


def test_14_1_refuses_to_run_with_the_library_formula():
    from course_lib.training.pipeline import bubble_formula

    def uses_library(p, target):
        m = 1
        while bubble_formula(p, m) > target:
            m += 1
        return m

    with pytest.raises(Exception, match="switched off"):
        check_min_microbatches(uses_library)


def _gpipe(stage, p, m):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def _circular(stage, p, m):           # stage 0 backs up before stage 1 has run its forwards: each waits for the other
    if stage == 0:
        return [a for i in range(m) for a in (("F", i), ("B", i))]
    return _gpipe(stage, p, m)


def _late(stage, p, m):               # one warm-up forward too few: no deadlock, but a bigger bubble
    warm = max(0, min(p - stage - 2, m))
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


@pytest.mark.parametrize("wrong,message", [
    (_gpipe, r"stage 1 keeps 2 micro-batches in flight.*All forwards before any backward is GPipe"),
    (_circular, r"the schedule deadlocks.*real ranks would hang in recv"),
    (_late, r"p=2, m=2, stage 0 idles 0.500 of the step on an ideal clock, more than the 0.333"),
])
def test_14_2_rejects_orders_that_hold_too_much_deadlock_or_idle(wrong, message):
    with pytest.raises(ExerciseFailed, match=message):
        check_one_f_one_b(wrong)


def _no_flag_exchange(stage, lr, scaler):      # decides on its own stage's gradients only
    found = not all(torch.isfinite(q.grad).all() for q in stage.parameters())
    dist.all_reduce(torch.zeros(1, device=stage.weight.device))
    if found:
        scaler["scale"] *= 0.5
        scaler["good_steps"] = 0
        return False
    with torch.no_grad():
        for q in stage.parameters():
            q -= lr * q.grad / scaler["scale"]
    scaler["good_steps"] += 1
    if scaler["good_steps"] == scaler["growth_interval"]:
        scaler["scale"] *= 2
        scaler["good_steps"] = 0
    return True


def test_14_3_rejects_stages_that_skip_alone():
    with pytest.raises(ExerciseFailed, match=r"2 stages, step 2: stage 0 stepped, stage 1 skipped.*skip it together"):
        check_loss_scaling(_no_flag_exchange)
