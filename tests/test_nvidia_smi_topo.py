"""Reading `nvidia-smi topo -m` (course_lib.costs.hardware) and drawing it (course_lib.viz.node_links): the published
output of notebook 02, and two more real outputs whose columns are tab-separated."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib.costs import hardware as hw  # noqa: E402
from course_lib.viz import node_links  # noqa: E402

# 8 GPUs on PCIe only, 2 NICs, columns separated by tabs: NVIDIA/nccl issue 1530 (first post),
# https://github.com/NVIDIA/nccl/issues/1530
PCIE_ONLY = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t0-15,64-79\t0\t\tN/A\n"
    "GPU1\tSYS\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t0-15,64-79\t0\t\tN/A\n"
    "GPU2\tSYS\tSYS\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t0-15,64-79\t0\t\tN/A\n"
    "GPU3\tSYS\tSYS\tSYS\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t16-31,80-95\t1\t\tN/A\n"
    "GPU4\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tSYS\tSYS\tSYS\tSYS\t32-47,96-111\t2\t\tN/A\n"
    "GPU5\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tSYS\tSYS\tSYS\t32-47,96-111\t2\t\tN/A\n"
    "GPU6\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tSYS\tSYS\t32-47,96-111\t2\t\tN/A\n"
    "GPU7\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tSYS\t48-63,112-127\t3\t\tN/A\n"
    "NIC0\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tPIX\t\t\t\t\n"
    "NIC1\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPIX\t X \t\t\t\t\n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
    "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node\n"
    "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n"
    "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n"
    "  PIX  = Connection traversing at most a single PCIe bridge\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
    "\n"
    "NIC Legend:\n"
    "\n"
    "  NIC0: mlx5_0\n"
    "  NIC1: mlx5_1\n"
)

# An older nvidia-smi: NICs named by their device (mlx5_*), no NUMA column, no legend in the post.
# NVIDIA/nccl issue 243 (first post), https://github.com/NVIDIA/nccl/issues/243
OLD_STYLE = (
    " \tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tmlx5_1\tmlx5_0\tCPU Affinity\n"
    "GPU0\t X \tPIX\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\t0-13,28-41\n"
    "GPU1\tPIX\t X \tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\t0-13,28-41\n"
    "GPU2\tNODE\tNODE\t X \tSYS\tSYS\tSYS\tSYS\tPIX\t0-13,28-41\n"
    "GPU3\tSYS\tSYS\tSYS\t X \tPIX\tNODE\tNODE\tSYS\t14-27,42-55\n"
    "GPU4\tSYS\tSYS\tSYS\tPIX\t X \tNODE\tNODE\tSYS\t14-27,42-55\n"
    "GPU5\tSYS\tSYS\tSYS\tNODE\tNODE\t X \tPIX\tSYS\t14-27,42-55\n"
    "mlx5_1\tSYS\tSYS\tSYS\tNODE\tNODE\tPIX\t X \tSYS\t\n"
    "mlx5_0\tNODE\tNODE\tPIX\tSYS\tSYS\tSYS\tSYS\t X \t\n"
)


@pytest.fixture(scope="module")
def h100():
    return hw.nvidia_smi_topo()


def test_the_published_output_names_its_source_and_machine():
    text = hw.nvidia_smi_topo_text()
    head = [ln for ln in text.splitlines() if ln.startswith("##")]
    assert head[0].startswith("## source:") and "https://github.com/sgl-project/sglang/issues/30401" in head[0]
    assert "NVIDIA H100 80GB HBM3" in head[1]
    assert text.count("\n## ") == 2 and "\t" not in text


def test_the_h100_server_parses_into_its_devices_links_and_numa_nodes(h100):
    assert h100["gpus"] == [f"GPU{i}" for i in range(8)] and h100["nics"] == [f"NIC{i}" for i in range(8)]
    for a in h100["gpus"]:
        assert [h100["path"][a][b] for b in h100["gpus"] if b != a] == ["NV18"] * 7
        assert a not in h100["path"][a]                                  # "X" (self) is left out
    assert h100["path"]["GPU0"]["NIC4"] == "SYS" and h100["path"]["GPU0"]["NIC1"] == "NODE"
    assert h100["path"]["NIC5"]["GPU5"] == "PIX"                          # the matrix is read from the NIC rows too
    assert [h100["columns"][g]["NUMA Affinity"] for g in h100["gpus"]] == ["0"] * 4 + ["1"] * 4
    assert h100["columns"]["GPU4"]["CPU Affinity"] == "48-95,144-191"
    assert h100["nic_names"] == {f"NIC{i}": f"mlx5_{i}" for i in range(8)}
    assert set(h100["legend"]) == {"X", "SYS", "NODE", "PHB", "PXB", "PIX", "NV#"}
    assert h100["legend"]["PIX"] == "Connection traversing at most a single PCIe bridge"


def test_every_h100_gpu_has_its_own_pix_nic(h100):
    assert hw.closest_nics(h100) == {f"GPU{i}": ([f"NIC{i}"], "PIX") for i in range(8)}


def test_the_path_order_is_nvmls():
    # nvmlGpuTopologyLevel_t: SINGLE 10, MULTIPLE 20, HOSTBRIDGE 30, NODE 40, SYSTEM 50
    assert hw.PCIE_PATHS == ("PIX", "PXB", "PHB", "NODE", "SYS")


def test_tab_separated_output_of_a_pcie_only_server():
    t = hw.parse_nvidia_smi_topo(PCIE_ONLY)
    assert len(t["gpus"]) == 8 and t["nics"] == ["NIC0", "NIC1"]
    assert t["columns"]["GPU7"] == {"CPU Affinity": "48-63,112-127", "NUMA Affinity": "3", "GPU NUMA ID": "N/A"}
    assert t["path"]["NIC0"]["NIC1"] == "PIX" and t["path"]["GPU3"]["GPU4"] == "SYS"
    # no NIC is near any GPU: both tie at SYS, and both are returned
    assert all(v == (["NIC0", "NIC1"], "SYS") for v in hw.closest_nics(t).values())
    assert t["nic_names"] == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}


def test_an_older_output_with_device_named_nics_and_no_legend():
    t = hw.parse_nvidia_smi_topo(OLD_STYLE)
    assert t["nics"] == ["mlx5_1", "mlx5_0"] and t["legend"] == {} and t["nic_names"] == {}
    assert t["columns"]["GPU3"] == {"CPU Affinity": "14-27,42-55"}
    near = hw.closest_nics(t)
    assert near["GPU2"] == (["mlx5_0"], "PIX") and near["GPU5"] == (["mlx5_1"], "PIX")
    assert near["GPU0"] == (["mlx5_0"], "NODE") and near["GPU3"] == (["mlx5_1"], "NODE")   # nearest, if far


def test_the_matrix_drawing_writes_every_cell_and_the_legend_of_the_kinds_used(h100):
    ax = node_links.topo_matrix(h100)
    cells = [t.get_text() for t in ax.texts]
    assert len(cells) == 16 * 16 and cells.count("PIX") == 16 and cells.count("X") == 16
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [lb.split(" =")[0] for lb in labels] == ["NV#", "PIX", "NODE", "SYS"]
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["GPU0 (NUMA 0)", "GPU1 (NUMA 0)"]
    assert [t.get_text() for t in ax.get_yticklabels()][8] == "NIC0 mlx5_0"
    plt.close(ax.figure)


def test_the_busbw_drawing_writes_each_fraction_of_the_line_rate():
    rows = [{"label": "ring", "busbw_GBps": 370, "line_GBps": 450},
            {"label": "NVLS", "busbw_GBps": 480, "line_GBps": 450}]
    ax = node_links.busbw_vs_line(rows)
    assert [t.get_text() for t in ax.texts] == ["82%", "107%"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["ring", "NVLS"]      # first row on top
    plt.close(ax.figure)
