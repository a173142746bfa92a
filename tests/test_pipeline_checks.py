"""The checkers of notebook 14 pass the right method and reject the wrong one of the kind each exercise is about,
with a message that says what went wrong (the right solutions also run in the notebook itself, under nbval)."""

import math

import pytest
import torch
import torch.distributed as dist

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.loss_scaling import check_loss_scaling
from course_lib.checks.pipeline import check_capped_order, check_min_microbatches


def _loop(p, target):
    m = 1
    while (p - 1) / (m + p - 1) > target:
        m += 1
    return m


def _closed_form(p, target):          # 13 for 12 at (p=4, t=0.2) and 25 for 24 at (p=7, t=0.2): float rounding
    return max(1, math.ceil((p - 1) * (1 - target) / target))


def _strict(p, target):               # "bubble below the target" where the task says "at most"
    m = 1
    while (p - 1) / (m + p - 1) >= target:
        m += 1
    return m


def test_14_1_passes_a_loop_and_the_float_closed_form_and_rejects_a_strict_bound(capsys):
    assert _closed_form(4, 0.2) == 13 and _closed_form(7, 0.2) == 25      # the float rounding the checker forgives
    check_min_microbatches(_loop)
    check_min_microbatches(_closed_form)
    assert capsys.readouterr().out.count("✓ Exercise 14.1") == 2
    with pytest.raises(ExerciseFailed, match=r"p=2 stages, target bubble 0.5: you returned m=2, expected 1"):
        check_min_microbatches(_strict)


def test_14_1_refuses_to_run_with_the_library_formula():
    from course_lib.training.pipeline import bubble_formula

    def uses_library(p, target):
        m = 1
        while bubble_formula(p, m) > target:
            m += 1
        return m

    def catches_it(p, target):        # tries the library, falls back on a loop
        try:
            return uses_library(p, target)
        except Exception:
            return _loop(p, target)

    for learner in (uses_library, catches_it):
        with pytest.raises(ExerciseFailed, match=r"Exercise 14.1 .* is about the bubble formula; .*switched off") as e:
            check_min_microbatches(learner)
        assert "SwitchedOff" not in str(e.value) and "Hint:" in str(e.value)


def test_14_1_refuses_the_librarys_clock_as_a_road_to_the_formula():
    """The schedules built and timed by the library's simulate: the right numbers, the formula by another road."""
    from course_lib.training.pipeline import simulate

    def times_gpipe(p, target):
        m = 1
        while True:
            orders = [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]
            span = max(e for r in simulate(orders) for *_, e in r)
            if (span - 3 * m) / span <= target:
                return m
            m += 1

    with pytest.raises(ExerciseFailed, match=r"Exercise 14.1 .* is about the bubble formula; .*switched off"):
        check_min_microbatches(times_gpipe)


def test_14_1_refuses_the_interleaved_replay_as_another_clock():
    """Section 7's replay of a plan on the ideal clock, fed a GPipe order: the formula by a third road."""
    from course_lib.training.interleaved import bubble, replay

    def times_replay(p, target):
        m = 1
        while True:
            order = {r: [("FORWARD", r, i) for i in range(m)] + [("FULL_BACKWARD", r, i) for i in range(m)]
                     for r in range(p)}
            if bubble(replay(order, p, 1), m) <= target:
                return m
            m += 1

    with pytest.raises(ExerciseFailed, match=r"Exercise 14.1 .*switched off"):
        check_min_microbatches(times_replay)


def test_14_2_refuses_the_checkers_own_warm_up_builder():
    from course_lib.checks.pipeline import _warm_1f1b

    with pytest.raises(ExerciseFailed, match=r"Exercise 14.2 .*switched off"):
        check_capped_order(lambda s, p, m, c: _warm_1f1b(s, p, m, min(p - s - 1, c - 1, m)))


def test_14_1_accepts_numpys_integers_and_refuses_a_float(capsys):
    import numpy as np

    check_min_microbatches(lambda p, t: np.int64(_loop(p, t)))
    assert "✓ Exercise 14.1" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match=r"you returned 1.0; a number of micro-batches is an integer"):
        check_min_microbatches(lambda p, t: float(_loop(p, t)))


def test_14_2_a_switched_off_order_is_the_exercises_failure():
    from course_lib.training.pipeline import one_f_one_b_order

    def tries_library(stage, p, m, cap):
        try:
            order = one_f_one_b_order(stage, p, m)
        except Exception:
            order = _counted(stage, p, m, cap)
        return order

    with pytest.raises(ExerciseFailed, match=r"Exercise 14.2 .* is about scheduling under a memory cap; "
                                             r".*switched off.*\nHint:"):
        check_capped_order(tries_library)


def _counted(stage, p, m, cap):       # a correct order written another way: forward while under the limit
    order, f, b, limit = [], 0, 0, min(cap, p - stage)
    while b < m:
        if f < m and f - b < limit:
            order.append(("F", f))
            f += 1
        else:
            order.append(("B", b))
            b += 1
    return order


def _plain_1f1b(stage, p, m, cap):    # the cell's 1F1B, cap ignored: right bubble, too much memory
    warm = min(p - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


def _cut_to_cap(stage, p, m, cap):   # the warm-up cut to cap, not cap - 1: one micro-batch over the cap
    warm = min(p - stage - 1, cap, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


def _gpipe(stage, p, m, cap=None):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def _circular(stage, p, m, cap):      # stage 0 backs up before stage 1 has run its forwards: each waits for the other
    if stage == 0:
        return [a for i in range(m) for a in (("F", i), ("B", i))]
    return [("F", i) for i in range(m)][:cap] + [a for i in range(min(cap, m), m) for a in (("B", i - cap),
                                                                                              ("F", i))] \
        + [("B", i) for i in range(max(0, m - cap), m)]


def _one_at_a_time(stage, p, m, cap):  # within any cap and deadlock-free, but every micro-batch alone in the pipe
    return [a for i in range(m) for a in (("F", i), ("B", i))]


def test_14_2_accepts_a_correct_order_written_another_way():
    check_capped_order(_counted)


@pytest.mark.parametrize("wrong,message", [
    (_plain_1f1b, r"stage 0 keeps 2 micro-batches in flight .*more than the cap.*same as plain 1F1B's"),
    (_cut_to_cap, r"cut to cap forwards.*may hold only cap - 1"),
    (_gpipe, r"cap=1, stage 0 keeps 2 micro-batches in flight"),
    (_circular, r"the schedule deadlocks.*real ranks would hang in recv"),
    (_one_at_a_time, r"p=2, m=2, cap=2: your step takes 12 slots on the ideal clock .*can do it in 9"),
])
def test_14_2_rejects_orders_over_the_cap_deadlocked_or_slow(wrong, message):
    with pytest.raises(ExerciseFailed, match=message):
        check_capped_order(wrong)


def _apply(stage, lr, scaler, ok):             # GradScaler's rules once the step knows whether it may step
    if not ok:
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


def _no_flag_exchange(stage, lr, scaler):      # decides on its own stage's gradients only
    found = not all(torch.isfinite(q.grad).all() for q in stage.parameters())
    dist.all_reduce(torch.zeros(1, device=stage.weight.device))
    return _apply(stage, lr, scaler, not found)


def test_14_3_rejects_stages_that_skip_alone():
    with pytest.raises(ExerciseFailed, match=r"2 stages, step 2: stage 0 stepped, stage 1 skipped.*skip it together"):
        check_loss_scaling(_no_flag_exchange)


def _isinf_only(stage, lr, scaler):            # counts inf as an overflow, lets NaN through
    bad = torch.tensor([float(any(torch.isinf(q.grad).any() for q in stage.parameters()))], device=stage.weight.device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return _apply(stage, lr, scaler, not bad.item())


def _torch_kernels(stage, lr, scaler):         # GradScaler's own kernels do the unscale and the scale update
    grads = [q.grad for q in stage.parameters()]
    found = torch.zeros(1, device=grads[0].device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones(1) / scaler["scale"])
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return not found.item()


def _sum_of_flags(stage, lr, scaler):          # correct, written otherwise: a SUM of 0/1 flags, one fused update
    bad = sum(int(not torch.isfinite(q.grad).all()) for q in stage.parameters())
    flags = torch.tensor([bad], dtype=torch.float64, device=stage.weight.device)
    dist.all_reduce(flags)
    ok = flags.item() == 0
    if ok:
        inv = 1.0 / scaler["scale"]
        with torch.no_grad():
            for q in stage.parameters():
                q.add_(q.grad, alpha=-lr * inv)
    good = scaler["good_steps"] + 1 if ok else 0
    scaler["scale"] = scaler["scale"] * (2 if good == scaler["growth_interval"] else 1) * (1 if ok else 0.5)
    scaler["good_steps"] = good % scaler["growth_interval"]
    return ok


def test_14_3_injects_nan_refuses_torchs_kernels_and_passes_another_correct_step(capsys):
    with pytest.raises(ExerciseFailed,
                       match=r"step 3: your step ran; it should be skipped \(a bias gradient on stage 0 is nan\)"):
        check_loss_scaling(_isinf_only)
    with pytest.raises(ExerciseFailed, match=r"GradScaler's kernel torch._amp_foreach_non_finite_check_and_unscale_ "
                                             r"is switched off here"):
        check_loss_scaling(_torch_kernels)
    check_loss_scaling(_sum_of_flags)
    assert "✓ Exercise 14b.1" in capsys.readouterr().out


def _weight_only(stage, lr, scaler):           # looks at one parameter's gradient: a bias overflow gets through
    bad = torch.tensor([float(not torch.isfinite(stage.weight.grad).all())], device=stage.weight.device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return _apply(stage, lr, scaler, not bad.item())


def _gathered_flags(stage, lr, scaler):        # correct with another single collective: every stage's flag, gathered
    mine = torch.tensor([float(not all(torch.isfinite(q.grad).all() for q in stage.parameters()))],
                        device=stage.weight.device)
    flags = torch.empty(dist.get_world_size(), device=mine.device)
    dist.all_gather_into_tensor(flags, mine)
    return _apply(stage, lr, scaler, flags.max().item() == 0)


def test_14b_1_refuses_a_check_of_the_weight_alone_and_accepts_any_one_collective(capsys):
    with pytest.raises(ExerciseFailed, match=r"it should be skipped \(a bias gradient on stage 0 is nan\)"):
        check_loss_scaling(_weight_only)
    check_loss_scaling(_gathered_flags)
    assert "✓ Exercise 14b.1" in capsys.readouterr().out


def test_14_3_says_the_courses_scaler_is_switched_off_and_its_hint_holds_no_algorithm():
    from course_lib.training.mixed_precision import LossScaler

    def by_the_courses_scaler(stage, lr, scaler):
        LossScaler(scaler["scale"], growth_interval=scaler["growth_interval"]).update(False)

    with pytest.raises(ExerciseFailed, match=r"LossScaler.update \(it holds the answer\) is switched off here") as e:
        check_loss_scaling(by_the_courses_scaler)
    hint = str(e.value).split("Hint:")[1].lower()
    assert "halve" not in hint and "double" not in hint and "all_reduce" not in hint
