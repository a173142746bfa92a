"""The checkers of notebook 12, tried as a learner would.

Exercise 12.1 (the time of a ZeRO-3 forward with prefetch, against the forward real gloo ranks took on the emulated
link): it refuses the library's own run and launching ranks (the shortcuts), a rule that is right only when every
layer is the same (a wrong method with the right numbers on the notebook's equal layers), and wrong times; it
accepts a closed form and an event-by-event simulation alike.

Exercise 12.2 (ZeRO-1 on one flat buffer, trained in float64 against single-process Adam): it refuses the library's
ZeRO step, a sum where the mean belongs (Adam's step hardly depends on the gradient's scale: it shows where ε is
not negligible beside √v̂), a bias correction one step off, and float32 buffers (named as such, whether they turn
the parameters to float32 or only travel); it accepts a flat buffer copied back parameter by parameter. (All-reduce
refused, views into one buffer accepted and a full state kept aside refused: tests/test_checks_training.py.)
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.sharding import check_prefetch_forward_s, check_zero1_flat_step


def closed_form(gather_s, compute_s):                 # layer i's compute runs beside layer i+1's all-gather
    n = len(gather_s)
    return gather_s[0] + sum(max(compute_s[i], gather_s[i + 1]) for i in range(n - 1)) + compute_s[-1]


def simulated(gather_s, compute_s):                   # the same, written as a clock: link and compute side by side
    computed = 0.0
    arrived = gather_s[0]
    for i, c in enumerate(compute_s):
        start = max(computed, arrived)                 # the weight is here and the previous layer is done
        if i + 1 < len(gather_s):
            arrived = start + gather_s[i + 1]          # the next gather is posted as this layer starts
        computed = start + c
    return computed


def test_a_closed_form_and_a_simulation_both_pass(capsys):
    check_prefetch_forward_s(closed_form)
    check_prefetch_forward_s(simulated)
    check_prefetch_forward_s(lambda a, c: np.float64(simulated(np.array(a), np.array(c))))   # numpy in and out
    assert capsys.readouterr().out.count("✓ Exercise 12.1 passed") == 3


def test_the_librarys_run_and_launching_ranks_are_refused():
    from course_lib import run
    from course_lib.training.prefetch import forward_times

    with pytest.raises(ExerciseFailed, match=r"training\.prefetch\.forward_times \(it holds the answer\) is "
                                             r"switched off"):
        check_prefetch_forward_s(lambda a, c: forward_times([96] * len(a), c, "100 MbE")["prefetch"]["seconds"])
    with pytest.raises(ExerciseFailed, match=r"starting ranks or processes \(course_lib\.runtime\.launch\.run\)"):
        check_prefetch_forward_s(lambda a, c: run(forward_times, 2, args=([96] * len(a), c, "100 MbE")))


def pairs_each_gather_with_its_own_layer(gather_s, compute_s):   # right whenever all layers are equal
    n = len(gather_s)
    return gather_s[0] + sum(max(compute_s[i], gather_s[i]) for i in range(n - 1)) + compute_s[-1]


def test_a_rule_right_only_for_equal_layers_is_refused_on_uneven_ones():
    with pytest.raises(ExerciseFailed, match=r"right time for layers of equal width; here they differ"):
        check_prefetch_forward_s(pairs_each_gather_with_its_own_layer)


def prefetches_without_limit(gather_s, compute_s):    # gathers back to back, as if every layer could be held
    gathered = computed = 0.0
    for a, c in zip(gather_s, compute_s):
        gathered += a
        computed = max(computed, gathered) + c
    return computed


@pytest.mark.parametrize("wrong", [
    lambda a, c: sum(a) + sum(c),                               # no overlap at all
    lambda a, c: sum(max(x, y) for x, y in zip(a, c)),          # every gather hidden, even the first
    lambda a, c: max(sum(a), sum(c)),                           # perfect overlap
    prefetches_without_limit,
    lambda a, c: [closed_form(a, c)],                           # the right number, not a number
], ids=["no-overlap", "first-hidden", "perfect-overlap", "unlimited-prefetch", "a-list"])
def test_wrong_times_are_refused_with_the_measured_one(wrong):
    with pytest.raises(ExerciseFailed, match=r"Exercise 12\.1: [23] ranks, layers of .* the forward with prefetch "
                                             r"took [0-9.]+ ms on the emulated link"):
        check_prefetch_forward_s(wrong)


# ---------------------------------------------------------------------------------------------- Exercise 12.2
def zero1_flat(params, m, v, t, lr, dtype=None, divide=True, t_shift=0, copy_back=False):
    """ZeRO-1 on one flat buffer; the keyword arguments make the usual mistakes."""
    from course_lib.training.adam import adam_step

    rank, p = dist.get_rank(), dist.get_world_size()
    n, c = sum(q.numel() for q in params), m.numel()
    flat = torch.zeros(p * c, dtype=dtype or m.dtype, device=m.device)
    flat[:n] = torch.cat([q.grad.reshape(-1) for q in params])
    g = flat.new_empty(c)
    dist.reduce_scatter_single(g, flat)
    if divide:
        g /= p
    flat[:n] = torch.cat([q.detach().reshape(-1) for q in params])
    w = flat[rank * c:(rank + 1) * c].clone()
    adam_step(w, g, m, v, t + t_shift, lr)
    dist.all_gather_single(flat, w)
    if copy_back:                                      # the parameters keep their dtype
        with torch.no_grad():
            for q, part in zip(params, flat[:n].split([q.numel() for q in params])):
                q.copy_(part.view_as(q))
    else:                                              # the parameters become views of the buffer
        torch.nn.utils.vector_to_parameters(flat[:n], params)


def zero1_copied_back(params, m, v, t, lr):            # right, written another way
    zero1_flat(params, m, v, t, lr, copy_back=True)


def zero1_by_the_library(params, m, v, t, lr):
    from course_lib.training import zero

    zero.zero1_step(params, {"m": [m], "v": [v]}, t, lr)


def test_a_flat_buffer_copied_back_by_parameter_passes(capsys):
    check_zero1_flat_step(zero1_copied_back)
    assert "✓ Exercise 12.2 passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (zero1_by_the_library, r"training\.zero\.zero1_step \(it holds the answer\) is switched off"),
    (lambda *a: zero1_flat(*a, divide=False), r"weights differ from single-process Adam by up to"),
    (lambda *a: zero1_flat(*a, t_shift=1), r"weights differ from single-process Adam by up to"),
    (lambda *a: zero1_flat(*a, dtype=torch.float32), r"after your step the parameters are torch\.float32"),
    (lambda *a: zero1_flat(*a, dtype=torch.float32, copy_back=True), r"B: a float32 buffer\)"),
], ids=["library", "sum-not-mean", "bias-correction-off-by-one", "float32-parameters", "float32-buffer"])
def test_wrong_zero1_steps_are_refused(wrong, message):
    with pytest.raises(ExerciseFailed, match=message):
        check_zero1_flat_step(wrong)
