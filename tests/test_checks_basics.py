"""The checkers of notebook 00 (course_lib/checks/basics.py) on what a learner may write: (a) the shortcut the
exercise rules out, (b) another method that gives the right numbers, (c) a plausible wrong result, each refused with
a sentence saying why, and (d) correct solutions written differently, which pass. One or two world sizes per call
keep this quick; the notebook's own check cells run 2 to 5 ranks."""

import pytest
import torch
import torch.distributed as dist

from course_lib import device
from course_lib.checks.basics import check_all_max, check_all_mean, check_rank_of_max
from course_lib.checks.core import ExerciseFailed

# ---------------------------------------------------------------- Exercise 0.1: all_max


def max_in_place(x):
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def max_from_everyone(x):  # (d) gather, then the maximum of the rows: a correct way the exercise does not rule out
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)
    x.copy_(torch.stack(everyone).amax(dim=0))
    return x


def max_on_a_copy(x):  # (c) right values in a new tensor; x itself, which the exercise names, is unchanged
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    return y


def min_instead(x):  # (c) the wrong reduction
    dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return x


@pytest.mark.parametrize("solution", [max_in_place, max_from_everyone])
def test_0_1_passes_a_correct_maximum_however_written(solution, capsys):
    check_all_max(solution, worlds=(3,))
    assert "Exercise 0.1 passed" in capsys.readouterr().out


def test_0_1_refuses_a_wrong_reduction_and_a_result_not_in_x():
    with pytest.raises(ExerciseFailed, match="wrong result"):
        check_all_max(min_instead, worlds=(2,))
    with pytest.raises(ExerciseFailed, match="tensor itself does not hold the result"):
        check_all_max(max_on_a_copy, worlds=(2,))


# ---------------------------------------------------------------- Exercise 0.2: all_mean


def mean_sum_then_divide(x):
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    x /= dist.get_world_size()
    return x


def mean_divide_then_sum(x):  # (d) DDP's order: divide first, then sum
    x /= dist.get_world_size()
    dist.all_reduce(x)
    return x


def mean_times_reciprocal(x):  # (d) a new tensor, a multiplication
    dist.all_reduce(x)
    return x * (1.0 / dist.get_world_size())


def mean_with_avg(x):  # (a) the shortcut the exercise rules out
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    return x


def mean_with_avg_on_the_group(x):  # (a) the same shortcut past dist.all_reduce
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    dist.group.WORLD.allreduce([x], opts).wait()
    return x


def mean_from_everyone(x):  # (b) right numbers by gathering every rank's tensor
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)
    return torch.stack(everyone).mean(dim=0)


def mean_functional(x):  # (d) the functional all_reduce, its reduction given as a string
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(x, "sum", dist.group.WORLD) / dist.get_world_size()


def mean_floor_divided(x):  # (c) floor division
    dist.all_reduce(x)
    x //= dist.get_world_size()
    return x


def mean_by_one_too_many(x):  # (c) divides by the largest rank instead of the count
    dist.all_reduce(x)
    return x / (dist.get_world_size() - 1)


@pytest.mark.parametrize("solution", [mean_sum_then_divide, mean_divide_then_sum, mean_times_reciprocal,
                                      mean_functional])
def test_0_2_passes_a_sum_and_a_division_in_either_order(solution, capsys):
    check_all_mean(solution, worlds=(3,))
    assert "Exercise 0.2 passed" in capsys.readouterr().out


@pytest.mark.parametrize("shortcut", [mean_with_avg, mean_with_avg_on_the_group])
def test_0_2_refuses_reduce_op_avg_however_reached(shortcut):
    with pytest.raises(ExerciseFailed, match=r"\('all_reduce', 'AVG'\).*every backend has"):
        check_all_mean(shortcut, worlds=(2,))


def mean_by_rows(x):  # (b) a gather disguised as one SUM all-reduce: each rank fills its own row
    rows = torch.zeros(dist.get_world_size(), *x.shape, dtype=x.dtype, device=x.device)
    rows[dist.get_rank()] = x
    dist.all_reduce(rows)
    return rows.mean(0)


def test_0_2_refuses_another_method_with_the_right_numbers():
    with pytest.raises(ExerciseFailed, match=r"\('all_gather', None\)"):
        check_all_mean(mean_from_everyone, worlds=(2,))
    with pytest.raises(ExerciseFailed, match="which is a gather, not a mean of x"):
        check_all_mean(mean_by_rows, worlds=(3,))


@pytest.mark.parametrize("wrong", [mean_floor_divided, mean_by_one_too_many])
def test_0_2_refuses_a_wrong_mean(wrong):
    with pytest.raises(ExerciseFailed, match="wrong result") as e:
        check_all_mean(wrong, worlds=(3,))
    assert "Hint: A mean is a sum divided by a count" in str(e.value)


# ---------------------------------------------------------------- Exercise 0.3: rank_of_max


def owner_by_min(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    largest = x.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    owner = torch.where(x == largest, rank, world)
    dist.all_reduce(owner, op=dist.ReduceOp.MIN)
    return owner


def owner_by_bits(x):  # (d) a SUM of one bit per holding rank, then the lowest set bit
    largest = x.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    bits = (x == largest).long() << dist.get_rank()
    dist.all_reduce(bits)
    return ((bits & -bits).double().log2()).long()


def owner_by_gather(x):  # (a) the shortcut: everyone's tensor, then argmax
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)
    return torch.stack(everyone).argmax(dim=0)


def owner_by_broadcasts(x):  # (a) the same data through broadcast, on the group object
    everyone = []
    for r in range(dist.get_world_size()):
        y = x.clone()
        dist.group.WORLD.broadcast(y, r).wait()
        everyone.append(y)
    return torch.stack(everyone).argmax(dim=0)


def owner_by_disguised_gather(x):  # (b) an all-reduce of a world_size-row tensor is a gather: right numbers
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.zeros(world, *x.shape, dtype=x.dtype, device=device())
    rows[rank] = x
    dist.all_reduce(rows)
    return rows.argmax(dim=0)


def owner_by_one_call_per_rank(x):  # (b) world_size all-reduces, each carrying one rank's tensor
    rows = []
    for r in range(dist.get_world_size()):
        y = x.clone() if r == dist.get_rank() else torch.zeros_like(x)
        dist.all_reduce(y)
        rows.append(y)
    return torch.stack(rows).argmax(dim=0)


def owner_largest_rank(x):  # (c) ties go to the largest rank
    largest = x.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    owner = torch.where(x == largest, dist.get_rank(), -1)
    dist.all_reduce(owner, op=dist.ReduceOp.MAX)
    return owner


def owner_as_float(x):  # (c) the right ranks in float32
    return owner_by_min(x).float()


@pytest.mark.parametrize("solution", [owner_by_min, owner_by_bits])
def test_0_3_passes_a_correct_owner_however_written(solution, capsys):
    check_rank_of_max(solution, worlds=(2, 4))
    assert "Exercise 0.3 passed" in capsys.readouterr().out


def owner_by_gather_on_a_thread(x):  # (a) the forbidden gather on another thread, where a dispatch mode sees nothing
    import threading

    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    th = threading.Thread(target=lambda: dist.group.WORLD.allgather([everyone], [x]).wait())
    th.start()
    th.join()
    return torch.stack(everyone).argmax(dim=0)


def owner_by_gather_in_a_callback(x):  # (a) the same in a future's callback, which runs on gloo's thread
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    work = dist.all_reduce(torch.zeros(1, device=x.device), async_op=True)
    work.get_future().then(lambda _: dist.group.WORLD.allgather([everyone], [x]).wait()).wait()
    return torch.stack(everyone).argmax(dim=0)


@pytest.mark.parametrize("shortcut,off", [(owner_by_gather, "all_gather"), (owner_by_broadcasts, "broadcast"),
                                          (owner_by_gather_on_a_thread, "starting threads"),
                                          (owner_by_gather_in_a_callback, "callbacks on a collective's future")])
def test_0_3_switches_off_every_collective_but_all_reduce(shortcut, off):
    with pytest.raises(ExerciseFailed, match=f"Exercise 0.3 is about finding an owner with all_reduce alone; .*{off}"):
        check_rank_of_max(shortcut, worlds=(2,))


def owner_by_packed_gather(x):  # (b) the same gather in float16: few bytes, but world_size times x's elements
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = torch.full((world, *x.shape), -1e4, dtype=torch.float16, device=x.device)
    rows[rank] = x.half()
    dist.all_reduce(rows, op=dist.ReduceOp.MAX)
    return rows.argmax(0)


def owner_by_one_key(x):  # (c) one call: value * world + (world - 1 - rank), right for whole numbers only
    world, rank = dist.get_world_size(), dist.get_rank()
    key = x.double() * world + (world - 1 - rank)
    dist.all_reduce(key, op=dist.ReduceOp.MAX)
    return (world - 1 - key.remainder(world)).round().long()


def test_0_3_refuses_a_gather_built_from_all_reduce():
    with pytest.raises(ExerciseFailed, match="a gather, not what the exercise asks"):
        check_rank_of_max(owner_by_disguised_gather, worlds=(2,))
    with pytest.raises(ExerciseFailed, match="more than x's"):
        check_rank_of_max(owner_by_packed_gather, worlds=(3,))
    with pytest.raises(ExerciseFailed, match="wrong result"):
        check_rank_of_max(owner_by_one_key, worlds=(2,))
    with pytest.raises(ExerciseFailed, match="made 3 all_reduce calls with 3 ranks; the exercise allows 2"):
        check_rank_of_max(owner_by_one_call_per_rank, worlds=(3,))


@pytest.mark.parametrize("wrong,what", [(owner_largest_rank, "got:      \\[1, 0, 1, 1,"),
                                        (owner_as_float, "float32")])
def test_0_3_refuses_the_wrong_tie_rule_and_the_wrong_dtype(wrong, what):
    with pytest.raises(ExerciseFailed, match="wrong result") as e:
        check_rank_of_max(wrong, worlds=(2,))
    assert what.replace("\\", "") in str(e.value)
