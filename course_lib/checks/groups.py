"""Checker for notebook 03's exercise 3.1: the row and column groups of a (nodes, gpus_per_node) grid, made by hand.

On 4 and 6 real ranks and several grid shapes, every rank first asks torch for the same groups
(``init_device_mesh``, before the learner's code runs, its groups destroyed at once so that no reference group is
left to find), then runs the learner's
``grid_all_reduce(t, nodes, gpus_per_node)`` on random integers drawn anew for every check, with the shortcuts
switched off (``init_device_mesh``, ``DeviceMesh``, ``new_subgroups``, ``new_subgroups_by_enumeration``,
``split_group``, every collective but all-reduce, the course's own mesh helpers) and every collective's group
recorded. The kernel then compares what came back with the mesh (members and group ranks), ``t`` with a sum it
computes itself in one process, and the method: one SUM all-reduce of the whole of ``t`` in the row, then one in
the column, on groups whose names mean the same members on every rank. torch names a group made by ``new_group``
by how many such groups this rank made before (``_process_group_name``, distributed_c10d.py), so a rank that skips
or reorders a call gives a name to other members than its peers do; ``use_local_synchronization=True`` names a
group by its ranks instead, so a solution that builds only its own two groups that way passes too (on gloo).
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import torch

from ..measure.c10d_ops import everything_but
from ..runtime.launch import run
from ..runtime.results import RankFailed
from .core import ExerciseFailed, _fmt, explain, learner_rules, passed, with_hint
from .group_calls import GroupsDiffer, GroupsUsed, _compared_calls, _names

# (world size, the grid shapes checked on it); a shape with one node or one GPU per node has a row or a column of
# one rank, and the other is the whole world
SHAPES = ((4, ((2, 2), (1, 4), (4, 1))), (6, ((2, 3), (3, 2))))
SIZE = 5
WHY = "building process groups by hand"
HINT = ("Number the ranks as section 4 does: which ranks share a node (a row), which share a GPU index (a column)? "
        "Every rank creates every one of these groups, in the same order, then sums in its own row, then in its own "
        "column.")
# Library roads to the answer, off while the learner's function runs: torch's own group builders (a DeviceMesh is
# a grid of groups) and the course's functions that lay ranks out on a mesh or hold this check's reference.
LIBRARY = ("torch.distributed.device_mesh.init_device_mesh",
           "torch.distributed.distributed_c10d.new_subgroups",
           "torch.distributed.distributed_c10d.new_subgroups_by_enumeration",
           "torch.distributed.distributed_c10d.split_group",
           "course_lib.training.mesh.mesh_groups", "course_lib.training.mesh.coordinate",
           "course_lib.training.mesh.place_on_nodes",
           "course_lib.checks.groups._mesh_answer")
CLASSES = (("torch.distributed.device_mesh.DeviceMesh.__init__", "DeviceMesh"),)


def _input(seed: int, case: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor in case ``case``: random integers (exact in float32 too), new for every check."""
    g = torch.Generator().manual_seed(seed + 7919 * case + rank)
    dtype = (torch.float32, torch.int64)[case % 2]
    return torch.randint(-99, 100, (SIZE,), generator=g).to(dtype)


def _mesh_answer(nodes: int, gpus: int) -> list:
    """On every rank: this rank's row and column as torch's init_device_mesh builds them, and its rank in each."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..runtime.devices import device

    mesh = init_device_mesh(device().type, (nodes, gpus), mesh_dim_names=("node", "gpu"))
    return [dist.get_process_group_ranks(mesh["gpu"].get_group()), mesh["gpu"].get_local_rank(),
            dist.get_process_group_ranks(mesh["node"].get_group()), mesh["node"].get_local_rank()]


@contextmanager
def _classes_off(exercise: str):
    """DeviceMesh's constructor refuses, with its class's name in the sentence (switch_off.py swaps code the same
    way, so a name the learner imported earlier refuses too)."""
    from . import switch_off as so

    stubs = []
    for path, shown in CLASSES:
        fn = so._resolve(path)
        key = f"{exercise}:{path}"
        so._refusals[key] = so._say(exercise, WHY, shown)
        stubs.append((fn, fn.__code__, so._stub_code(fn, key)))
    for fn, _, stub in stubs:
        fn.__code__ = stub
    try:
        yield
    finally:
        for fn, code, _ in stubs:
            fn.__code__ = code


def _plain(x):
    """What the learner returned, made plain for the kernel (tensors as lists or numbers)."""
    if isinstance(x, torch.Tensor) or hasattr(x, "tolist"):       # a tensor, or numpy's arrays and integers
        return x.tolist()
    if isinstance(x, range):
        return list(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _grid_cases(exercise, learner, shapes, first, seed, wait_s):
    """Runs on every rank: for each shape, torch's mesh first, then the learner's function, watched."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from ..runtime.devices import device
    from .core import CaseFailed
    from .switch_off import SwitchedOff, switched_off

    rank = dist.get_rank()
    out = []
    for k, (nodes, gpus) in enumerate(shapes):
        before = set(_world.pg_map)
        want = _mesh_answer(nodes, gpus)
        dist.barrier()        # every rank is done connecting the mesh's groups before any is closed
        for pg in [pg for pg in _world.pg_map if pg not in before]:
            dist.destroy_process_group(pg)   # no group of the reference is left for the learner's code to find
        print(f"checking {nodes} nodes x {gpus} GPUs", flush=True)   # the last line a rank printed names a hang
        x = _input(seed, first + k, rank).to(device())
        names, count = set(_world.pg_names.values()), _world.group_count
        try:
            with switched_off(exercise, everything_but("all_reduce"), WHY, LIBRARY), _classes_off(exercise), \
                    _compared_calls(first + k, (nodes, gpus), wait_s), GroupsUsed() as used:
                got = learner(x, nodes, gpus)
        except (NotImplementedError, SwitchedOff, GroupsDiffer):
            raise
        except Exception as exc:
            raise CaseFailed(f"with {nodes} nodes x {gpus} GPUs: {type(exc).__name__}: {exc}").with_traceback(
                exc.__traceback__) from None
        made = {name: sorted(_world.pg_group_ranks[pg]) for pg, name in _world.pg_names.items() if name not in names}
        dist.barrier()        # the next shape starts when every rank is done with this one
        out.append({"want": want, "got": _plain(got), "t": x.cpu(), "used": used.calls, "made": made,
                    "count": _world.group_count - count})
    return out


def _ranks(x):
    """A list of ranks as plain ints, or None when x is not one."""
    if not isinstance(x, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        return None
    return list(x)


def _judge(shape, case: int, seed: int, per_rank: list[dict]) -> str | None:
    """What is wrong with one shape's results on every rank, or None."""
    nodes, gpus = shape
    world = nodes * gpus
    # 1. what each rank returned, against init_device_mesh's groups
    for r, rec in enumerate(per_rank):
        got = rec["got"]
        if not (isinstance(got, (list, tuple)) and len(got) == 4):
            return (f"rank {r} returned {got!r:.120}; return four things: (row_ranks, row_rank, col_ranks, "
                    "col_rank).")
        row, row_rank, col, col_rank = got
        want_row, want_row_rank, want_col, want_col_rank = rec["want"]
        for what, mine, want in (("row", row, want_row), ("column", col, want_col)):
            if _ranks(mine) is None:
                return f"rank {r} returned {mine!r:.80} as its {what}; return a list of ranks (ints)."
            if _ranks(mine) != want:
                sorted_note = " (list them in increasing order)" if sorted(mine) == want else ""
                return (f"rank {r} (node {r // gpus}, GPU {r % gpus}) returned [{_names(mine)}] as its {what}"
                        f"{sorted_note}; that is not the {what} init_device_mesh(..., ({nodes}, {gpus})) puts it in.")
        for what, mine, want in (("row", row_rank, want_row_rank), ("column", col_rank, want_col_rank)):
            if not isinstance(mine, int) or isinstance(mine, bool) or mine != want:
                return (f"rank {r} returned {mine!r:.40} as its rank in its {what}; a group rank is the position "
                        f"of the global rank in the group's sorted members (dist.get_rank(group)).")
    # 2. the sum, against one computed here in one process
    want_t = sum(_input(seed, case, r) for r in range(world))
    for r, rec in enumerate(per_rank):
        t = rec["t"]
        if not (t.dtype == want_t.dtype and t.shape == want_t.shape and torch.equal(t, want_t)):
            return (f"wrong result on rank {r}: t must hold the sum over every rank after the row and the column "
                    f"all-reduce.\n  expected: {_fmt(want_t)}\n  got:      {_fmt(t)}")
    # 3. the method: one all-reduce of all of t in the row, then one in the column
    for r, rec in enumerate(per_rank):
        want_row, want_row_rank, want_col, want_col_rank = rec["want"]
        calls = rec["used"]
        said = "; ".join(f"{name} on ranks [{_names(ranks)}]" for name, ranks, *_ in calls) or "no collective"
        if [(c[0], c[1]) for c in calls] != [("all_reduce", want_row), ("all_reduce", want_col)]:
            world_note = (" An all-reduce over the whole world gives every rank the same sum, but not through the "
                          "grid's groups." if any(c[1] == list(range(world)) for c in calls) and world not in
                          (len(want_row), len(want_col)) else "")
            return (f"rank {r} ran {said}; the method is one all_reduce in this rank's row, then one in its column, "
                    f"on the groups your function made.{world_note}")
        for _, ranks, _, op, numel in calls:
            if op not in (None, "SUM"):
                return f"rank {r} ran an all_reduce with op {op} on ranks [{_names(ranks)}]; the sum is ReduceOp.SUM."
            if numel != SIZE:
                return (f"rank {r} all-reduced {numel} element(s) on ranks [{_names(ranks)}]; t has {SIZE}: "
                        "all-reduce t itself.")
        if (calls[0][2], calls[1][2]) != (rec["got"][1], rec["got"][3]):
            return (f"rank {r} returned group ranks {rec['got'][1]} and {rec['got'][3]}, but its rank in the groups "
                    f"its all-reduces ran on was {calls[0][2]} and {calls[1][2]}.")
    # 4. the groups: every name means the same members on every rank that holds it
    holders: dict[str, dict[tuple, list[int]]] = {}
    for r, rec in enumerate(per_rank):
        for name, members in rec["made"].items():
            holders.setdefault(name, {}).setdefault(tuple(members), []).append(r)
    for name, kinds in holders.items():
        if len(kinds) > 1:
            (a, ra), (b, rb) = list(kinds.items())[:2]
            return (f"the group named {name!r} holds ranks [{_names(list(a))}] on rank(s) {_names(ra)} but "
                    f"[{_names(list(b))}] on rank(s) {_names(rb)}. torch names a new_group by how many groups this "
                    "rank made before it, so the ranks did not create the same groups in the same order: every "
                    "rank calls new_group for every group, even for those it is not in.")
    counts = {r: rec["count"] for r, rec in enumerate(per_rank)}
    if len(set(counts.values())) > 1:
        return (f"the ranks made different numbers of groups with new_group (rank: groups made {counts}): every "
                "rank calls new_group for every group, even for those it is not in, or its next group gets "
                "another name than its peers give it.")
    return None


def check_grid_groups(grid_all_reduce, exercise: str = "Exercise 3.1", shapes=SHAPES, timeout: float = 20.0):
    """``grid_all_reduce(t, nodes, gpus_per_node)`` builds every row and column group of the grid, sums t in place
    over this rank's row then its column, and returns (row_ranks, row_rank, col_ranks, col_rank)."""
    seed = random.randrange(1 << 30)
    first, checked = 0, []
    for world, grid in shapes:
        try:
            res = run(_grid_cases, world, args=(exercise, grid_all_reduce, grid, first, seed, min(5.0, timeout / 3)),
                      timeout=timeout, output="none", nccl_rules=learner_rules("auto"))
        except RankFailed as exc:
            if exc.failure.etype == "GroupsDiffer":
                raise ExerciseFailed(with_hint(f"{exercise}: {exc.failure.message}", HINT)) from None
            if exc.failure.etype == "CaseFailed":
                case = exc.failure.message.split(":", 1)[0].removeprefix("with ")
                how = ("did not finish in time (a deadlock, or a machine too busy: run the check again)"
                       if "Timed out" in exc.failure.message else "failed")
                raise ExerciseFailed(with_hint(f"{exercise}: your function {how} with {case}.\n\n{exc}",
                                               HINT)) from None
            raise explain(exercise, exc, f"{world} ranks", HINT) from None
        for k, shape in enumerate(grid):
            wrong = _judge(shape, first + k, seed, [v[k] for v in res.values])
            if wrong:
                raise ExerciseFailed(with_hint(f"{exercise}: with {shape[0]} nodes x {shape[1]} GPUs: {wrong}",
                                               HINT))
            checked.append(f"{shape[0]}x{shape[1]}")
        first += len(grid)
    passed(exercise, f"grids {', '.join(checked)} on 4 and 6 ranks: every rank's row and column and its rank in "
                     "each equal init_device_mesh's, t holds the sum a single process computes, and each rank ran "
                     "one all_reduce in its row, then one in its column, on groups your function made, named alike on "
                     "every rank.")
