"""The pieces of notebooks/17_multi_node_lab.ipynb that need no torchrun: doctor's NCCL version and the rendezvous
drawing (the two-"node" launches themselves are in test_labs.py and the notebook's own cells)."""

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from course_lib.classroom import doctor  # noqa: E402
from course_lib.viz.rendezvous import rendezvous  # noqa: E402


def test_doctor_names_the_nccl_version_where_torch_has_one(monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert doctor.nccl_version() is None                 # a CPU build: "nccl no", nothing more to say
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 5))
    assert doctor.nccl_version() == "2.27.5"
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5, "a0"))
    assert doctor.nccl_version() == "2.21.5+a0"


def _workers(group_of_first_torchrun: int):
    out = []
    for t in (0, 1):
        node = group_of_first_torchrun if t == 0 else 1 - group_of_first_torchrun
        for local in (0, 1):
            out.append(dict(torchrun=t, rank=2 * node + local, local_rank=local, node=node, backend="gloo",
                            master="127.0.0.1:50000"))
    return out


def test_the_rendezvous_drawing_shows_what_the_run_printed():
    ax = rendezvous(_workers(0), "127.0.0.1:40000", rdzv_host=0)
    texts = [t.get_text() for t in ax.texts]
    assert "torchrun 0: GROUP_RANK 0" in texts and "torchrun 1: GROUP_RANK 1" in texts
    assert any("127.0.0.1:40000" in t for t in texts) and any("127.0.0.1:50000" in t for t in texts)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "gloo pair across nodes (4 of 6)" in labels and "gloo pair inside a node (2)" in labels
    assert ax.get_title().endswith("nodes of ranks [0, 0, 1, 1]")
    # c10d may call the rendezvous host's node 1: the drawing follows the run, the store beside rank 0
    ax = rendezvous(_workers(1), "127.0.0.1:40000", rdzv_host=0)
    assert "torchrun 0: GROUP_RANK 1" in [t.get_text() for t in ax.texts]


def test_the_store_lines_are_drawn_above_the_node_boxes():
    # each worker's dotted line to the workers' store must show over its node's filled box, not under it
    ax = rendezvous(_workers(0), "127.0.0.1:40000", rdzv_host=0)
    dotted = [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]
    boxes = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("#f7f7f7")]
    assert len(dotted) == 4 and boxes and all(ln.get_zorder() > max(b.get_zorder() for b in boxes) for ln in dotted)


def test_the_two_node_drawing_has_a_nic_per_gpu_and_the_labels_it_was_given():
    from course_lib.viz.two_nodes import two_nodes

    ax = two_nodes("NVLink: 300", "NIC: 25", gpus=8)
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("NIC 0") == 2 and sum(t.startswith("GPU ") for t in texts) == 16
    assert [t.get_text() for t in ax.get_legend().get_texts()][::2] == ["NVLink: 300", "NIC: 25"]
