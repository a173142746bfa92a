"""Exercise 3.1's checker (the row and column groups of any grid, course_lib/checks/groups.py) passes correct
solutions written in several ways and refuses, with a message that says why: torch's and the course's shortcuts
(a), a wrong method that gives the right numbers (b), and a wrong result (c)."""

import pytest
import torch
import torch.distributed as dist

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.groups import check_grid_groups

ONE = ((4, ((2, 2),)),)                    # one launch, one shape: enough to see a refusal
SMALL = ((4, ((2, 2), (1, 4), (4, 1))),)   # every kind of shape on 4 ranks


def _lists(nodes, gpus):
    rows = [[n * gpus + c for c in range(gpus)] for n in range(nodes)]
    cols = [[n * gpus + c for n in range(nodes)] for c in range(gpus)]
    return rows, cols


def grid_good(t, nodes, gpus):  # the notebook's solution: every rank makes every group, rows then columns
    rows, cols = _lists(nodes, gpus)
    row_groups = [dist.new_group(r) for r in rows]
    col_groups = [dist.new_group(c) for c in cols]
    rank = dist.get_rank()
    row, col = row_groups[rank // gpus], col_groups[rank % gpus]
    dist.all_reduce(t, group=row)
    dist.all_reduce(t, group=col)
    return rows[rank // gpus], dist.get_rank(row), cols[rank % gpus], dist.get_rank(col)


# ------------------------------------------------------------------ (d) correct, written differently

def grid_columns_first_functional(t, nodes, gpus):  # another loop order, another road to the same all-reduce
    import torch.distributed._functional_collectives as fc

    rank = dist.get_rank()
    rows, cols = _lists(nodes, gpus)
    made = {}
    for c in reversed(range(gpus)):        # columns first, backwards: the same order on every rank is what counts
        made[("col", c)] = dist.new_group(cols[c])
    for n in range(nodes):
        made[("row", n)] = dist.new_group(rows[n])
    row, col = made[("row", rank // gpus)], made[("col", rank % gpus)]
    t.copy_(fc.all_reduce(t, "sum", row))
    work = dist.all_reduce(t, group=col, async_op=True)
    work.wait()
    return (dist.get_process_group_ranks(row), dist.get_group_rank(row, rank),
            tuple(dist.get_process_group_ranks(col)), dist.get_group_rank(col, rank))


def grid_local_sync(t, nodes, gpus):  # only the members make each group: allowed with use_local_synchronization
    rank = dist.get_rank()
    node, gpu = divmod(rank, gpus)
    row_ranks = list(range(node * gpus, node * gpus + gpus))
    col_ranks = list(range(gpu, nodes * gpus, gpus))
    row = dist.new_group(row_ranks, use_local_synchronization=True)
    col = dist.new_group(col_ranks, use_local_synchronization=True)
    dist.all_reduce(t, group=row)
    dist.all_reduce(t, group=col)
    return range(node * gpus, node * gpus + gpus), gpu, range(gpu, nodes * gpus, gpus), node   # ranges are lists too


def grid_ends_in_a_barrier(t, nodes, gpus):  # a barrier moves no data: it stays on
    out = grid_good(t, nodes, gpus)
    dist.barrier()
    return out


def test_correct_solutions_pass(capsys):
    check_grid_groups(grid_good)
    check_grid_groups(grid_columns_first_functional, shapes=SMALL)
    check_grid_groups(grid_local_sync, shapes=SMALL)
    check_grid_groups(grid_ends_in_a_barrier, shapes=ONE)
    assert capsys.readouterr().out.count("✓ Exercise 3.1 passed") == 4


# ------------------------------------------------------------------ (a) shortcuts

def grid_by_mesh(t, nodes, gpus):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (nodes, gpus), mesh_dim_names=("node", "gpu"))
    dist.all_reduce(t, group=mesh["gpu"].get_group())
    dist.all_reduce(t, group=mesh["node"].get_group())
    return (dist.get_process_group_ranks(mesh["gpu"].get_group()), mesh["gpu"].get_local_rank(),
            dist.get_process_group_ranks(mesh["node"].get_group()), mesh["node"].get_local_rank())


def grid_by_device_mesh_class(t, nodes, gpus):
    from torch.distributed.device_mesh import DeviceMesh

    DeviceMesh("cpu", torch.arange(nodes * gpus).reshape(nodes, gpus))


def grid_by_enumeration(t, nodes, gpus):
    rows, cols = _lists(nodes, gpus)
    row, _ = dist.new_subgroups_by_enumeration(rows)
    col, _ = dist.new_subgroups_by_enumeration(cols)
    dist.all_reduce(t, group=row)
    dist.all_reduce(t, group=col)


def grid_by_course_mesh(t, nodes, gpus):
    from course_lib.training.mesh import mesh_groups

    return mesh_groups((nodes, gpus), 1)


def grid_caught_and_carried_on(t, nodes, gpus):  # the refusal caught, then the right answer by hand
    try:
        dist.new_subgroups_by_enumeration(_lists(nodes, gpus)[0])
    except RuntimeError:
        pass
    return grid_good(t, nodes, gpus)


def test_shortcuts_are_refused():
    for way, what in ((grid_by_mesh, r"dist\.init_device_mesh"), (grid_by_device_mesh_class, r"DeviceMesh"),
                      (grid_by_enumeration, r"dist\.new_subgroups_by_enumeration"),
                      (grid_by_course_mesh, r"the course's own training\.mesh\.mesh_groups \(it holds the answer\)")):
        with pytest.raises(ExerciseFailed, match=rf"Exercise 3\.1 is about building process groups by hand; {what} "
                                                 r"is switched off here"):
            check_grid_groups(way, shapes=ONE)
    with pytest.raises(ExerciseFailed, match=r"your code caught the error and went on"):
        check_grid_groups(grid_caught_and_carried_on, shapes=ONE)


# ------------------------------------------------------------------ (b) the right numbers by a wrong method

def grid_world_sum(t, nodes, gpus):  # one all-reduce over the world gives the same numbers; the lists by arithmetic
    rank = dist.get_rank()
    node, gpu = divmod(rank, gpus)
    dist.all_reduce(t)
    return list(range(node * gpus, node * gpus + gpus)), gpu, list(range(gpu, nodes * gpus, gpus)), node


def grid_members_only(t, nodes, gpus):  # each rank makes only its own two groups, with plain new_group
    rank = dist.get_rank()
    node, gpu = divmod(rank, gpus)
    row_ranks = list(range(node * gpus, node * gpus + gpus))
    col_ranks = list(range(gpu, nodes * gpus, gpus))
    row, col = dist.new_group(row_ranks), dist.new_group(col_ranks)
    dist.all_reduce(t, group=row)
    dist.all_reduce(t, group=col)
    return row_ranks, gpu, col_ranks, node


def grid_skips_a_group(t, nodes, gpus):  # rank 0 leaves out the last column, which it is not in
    rows, cols = _lists(nodes, gpus)
    rank = dist.get_rank()
    row_groups = [dist.new_group(r) for r in rows]
    col_groups = [dist.new_group(c) for c in (cols[:-1] if rank == 0 else cols)]
    row, col = row_groups[rank // gpus], col_groups[rank % gpus]
    dist.all_reduce(t, group=row)
    dist.all_reduce(t, group=col)
    return rows[rank // gpus], dist.get_rank(row), cols[rank % gpus], dist.get_rank(col)


def grid_column_then_row(t, nodes, gpus):  # the same sum, the steps swapped
    rows, cols = _lists(nodes, gpus)
    row_groups = [dist.new_group(r) for r in rows]
    col_groups = [dist.new_group(c) for c in cols]
    rank = dist.get_rank()
    row, col = row_groups[rank // gpus], col_groups[rank % gpus]
    dist.all_reduce(t, group=col)
    dist.all_reduce(t, group=row)
    return rows[rank // gpus], dist.get_rank(row), cols[rank % gpus], dist.get_rank(col)


def grid_finds_groups(t, nodes, gpus):  # makes no group: looks up groups by their ranks (the reference's, if alive)
    from torch.distributed.distributed_c10d import _find_pg_by_ranks_and_tag

    rows, cols = _lists(nodes, gpus)
    rank = dist.get_rank()
    row = _find_pg_by_ranks_and_tag("", rows[rank // gpus])
    col = _find_pg_by_ranks_and_tag("", cols[rank % gpus])
    dist.all_reduce(t, group=row)
    dist.all_reduce(t, group=col)
    return rows[rank // gpus], rank % gpus, cols[rank % gpus], rank // gpus


def grid_functional_rank_lists(t, nodes, gpus):  # makes no group: the functional collectives' rank-list form
    import torch.distributed._functional_collectives as fc

    rows, cols = _lists(nodes, gpus)
    rank = dist.get_rank()
    t.copy_(fc.all_reduce(t, "sum", rows[rank // gpus]))
    t.copy_(fc.all_reduce(t, "sum", cols[rank % gpus]))
    return rows[rank // gpus], rank % gpus, cols[rank % gpus], rank // gpus


def test_groups_not_made_by_the_learner_are_refused():
    # the reference's init_device_mesh groups are destroyed before the learner's code runs, so neither way finds
    # them: the first falls back to the world group (its sum counts every value twice), the second cannot create a
    # group without a tag
    with pytest.raises(ExerciseFailed, match=r"wrong result on rank 0: t must hold the sum"):
        check_grid_groups(grid_finds_groups, shapes=ONE)
    with pytest.raises(ExerciseFailed, match=r"your function failed with 2 nodes x 2 GPUs"):
        check_grid_groups(grid_functional_rank_lists, shapes=ONE)


def test_right_numbers_by_a_wrong_method_are_refused():
    with pytest.raises(ExerciseFailed, match=r"rank 0 ran all_reduce on ranks \[0, 1, 2, 3\]; the method is one "
                                             r"all_reduce in this rank's row, then one in its column"):
        check_grid_groups(grid_world_sum, shapes=ONE)
    with pytest.raises(ExerciseFailed, match=r"new_group call number 1 named different ranks \(rank 0: "
                                             r"new_group\(\[0, 1\]\);.*rank 2: new_group\(\[2, 3\]\)"):
        check_grid_groups(grid_members_only, shapes=ONE)
    with pytest.raises(ExerciseFailed, match=r"rank\(s\) 0 made no call number 4 within"):
        check_grid_groups(grid_skips_a_group, shapes=ONE, timeout=9)
    with pytest.raises(ExerciseFailed, match=r"all_reduce on ranks \[0, 2\]; all_reduce on ranks \[0, 1\]; the "
                                             r"method is one all_reduce in this rank's row, then one in its column"):
        check_grid_groups(grid_column_then_row, shapes=ONE)


# ------------------------------------------------------------------ (c) wrong results

def grid_max_in_columns(t, nodes, gpus):
    rows, cols = _lists(nodes, gpus)
    row_groups = [dist.new_group(r) for r in rows]
    col_groups = [dist.new_group(c) for c in cols]
    rank = dist.get_rank()
    dist.all_reduce(t, group=row_groups[rank // gpus])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=col_groups[rank % gpus])
    return rows[rank // gpus], rank % gpus, cols[rank % gpus], rank // gpus


def grid_columns_as_blocks(t, nodes, gpus):  # columns taken as consecutive ranks: rows and columns mixed up
    rank = dist.get_rank()
    rows, _ = _lists(nodes, gpus)
    blocks = [list(range(c * nodes, c * nodes + nodes)) for c in range(gpus)]
    row_groups = [dist.new_group(r) for r in rows]
    col_groups = [dist.new_group(b) for b in blocks]
    col = next(i for i, b in enumerate(blocks) if rank in b)
    dist.all_reduce(t, group=row_groups[rank // gpus])
    dist.all_reduce(t, group=col_groups[col])
    return rows[rank // gpus], rank % gpus, blocks[col], blocks[col].index(rank)


def grid_global_ranks_as_group_ranks(t, nodes, gpus):
    out = list(grid_good(t, nodes, gpus))
    out[1] = dist.get_rank()
    return tuple(out)


def test_wrong_results_are_refused():
    with pytest.raises(ExerciseFailed, match=r"wrong result on rank 0: t must hold the sum"):
        check_grid_groups(grid_max_in_columns, shapes=ONE)
    with pytest.raises(ExerciseFailed, match=r"with 3 nodes x 2 GPUs: rank 0 \(node 0, GPU 0\) returned \[0, 1, 2\] "
                                             r"as its column"):
        check_grid_groups(grid_columns_as_blocks, shapes=((6, ((3, 2),)),))
    with pytest.raises(ExerciseFailed, match=r"rank 2 returned 2 as its rank in its row"):
        check_grid_groups(grid_global_ranks_as_group_ranks, shapes=ONE)
