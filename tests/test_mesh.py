"""Device meshes (notebook 15): FSDP2 x tensor parallel and HSDP on a 2 x 2 mesh of 4 gloo ranks train to the weights
of single-process SGD (float64, within tolerance.sgd_atol); the groups torch builds are the row-major rule's; a
published layout placed on nodes; data/parallel_layouts.csv consistent (the degrees multiply to the GPUs); and the
mesh-groups checker rejecting a column-major answer and torch's private layout helper."""

import math

import pytest
import torch

from course_lib import run
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.expert_parallel import check_mesh_groups
from course_lib.costs import hardware
from course_lib.training.mesh import coordinate, mesh_groups, mesh_train, place_on_nodes
from course_lib.training.model import train_single
from course_lib.training.tolerance import max_diff, sgd_atol


def test_fsdp_x_tp_and_hsdp_train_to_single_process_sgd():
    res = run(lambda: [mesh_train("fsdp_tp"), mesh_train("hsdp")], world_size=4, output="none", timeout=180)
    for i, (workers, names) in enumerate(((2, ("dp", "tp")), (4, ("replicate", "shard")))):
        ref, _ = train_single(workers, 5, 16, lr=0.1, hidden=64, dtype=torch.float64)
        atol = sgd_atol(5, 0.1, 16 * workers, 64, torch.float64)
        for rank, v in enumerate(res.values):
            assert max_diff(v[i]["params"], ref) < atol, (names, rank)
            assert v[i]["coordinate"] == coordinate(rank, (2, 2))
            for dim, name in enumerate(names):
                assert v[i]["groups"][name] in mesh_groups((2, 2), dim)
    assert res.values[0][1]["placements"][0] == "(Replicate(), Shard(dim=0))"       # HSDP, as fully_shard says


def test_mesh_groups_and_placement_on_nodes():
    assert mesh_groups((2, 3), 0) == [[0, 3], [1, 4], [2, 5]] and mesh_groups((2, 3), 1) == [[0, 1, 2], [3, 4, 5]]
    for shape in ((2, 2, 2), (3, 1, 4)):
        for dim in range(len(shape)):
            groups = mesh_groups(shape, dim)
            assert sorted(r for g in groups for r in g) == list(range(math.prod(shape)))
            assert all(len({coordinate(r, shape)[:dim] + coordinate(r, shape)[dim + 1:] for r in g}) == 1
                       for g in groups)
    llama = place_on_nodes({"tp": 8, "cp": 16, "pp": 16, "dp": 8}, gpus_per_node=8)
    assert llama["tp"]["inside_a_node"] and llama["cp"]["nodes_spanned"] == 16 and llama["cp"]["node_stride"] == 1
    assert llama["pp"]["node_stride"] == 16 and llama["dp"]["node_stride"] == 256
    assert llama["tp"]["groups"] == 2048 and llama["dp"]["groups"] == 2048


def test_parallel_layouts_table_is_consistent():
    rows = hardware.load_table("parallel_layouts")
    assert {r["model"].split(" (")[0] for r in rows} >= {"Llama 3 405B", "DeepSeek-V3", "BLOOM-176B"}
    for r in rows:
        if r["gpus"]:
            assert r["tp"] * r["cp"] * r["pp"] * r["dp"] == r["gpus"], r["model"]
            assert r["dp"] % r["ep"] == 0, r["model"]
        if r["seq_len"] and r["global_batch"] and r["model"].startswith("Llama 3"):
            assert abs(r["seq_len"] * r["global_batch"] - 16 * 2 ** 20) / 2 ** 24 < 0.01   # 16M tokens a batch


def test_mesh_groups_checker_rejects_column_major(capsys):
    def right(shape, dim):
        return torch.arange(math.prod(shape)).reshape(shape).movedim(dim, -1).reshape(-1, shape[dim]).tolist()

    def column_major(shape, dim):                 # Fortran order: the FIRST dimension varies fastest
        ranks = torch.arange(math.prod(shape)).reshape(tuple(reversed(shape))).permute(*reversed(range(len(shape))))
        return ranks.movedim(dim, -1).reshape(-1, shape[dim]).tolist()

    check_mesh_groups(right)
    assert "✓ Exercise 15.1" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="init_device_mesh on 4 real ranks built"):
        check_mesh_groups(column_major)


def test_mesh_groups_checker_switches_off_torchs_private_layout():
    def private(shape, dim):                      # the helper init_device_mesh computes its groups with
        from torch.distributed._mesh_layout import _MeshLayout
        return _MeshLayout.from_sizes_strides(tuple(shape))[dim].global_ranks(math.prod(shape))

    with pytest.raises(ExerciseFailed, match=r"laying ranks out on a mesh; torch's private mesh layout "
                                             r"\(torch.distributed._mesh_layout.*is switched off"):
        check_mesh_groups(private)
