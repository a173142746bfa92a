"""Topology descriptions have the structure the lesson claims, and every description draws."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib.viz import topology as t  # noqa: E402


def _neighbours(desc, nid):
    return {e["b"] if e["a"] == nid else e["a"] for e in desc["edges"] if nid in (e["a"], e["b"])}


def test_server_every_gpu_on_nvswitch_and_a_pcie_path_to_a_cpu_and_nic():
    d = t.server_8gpu()
    gpus = [n for n, v in d["nodes"].items() if v["kind"] == "gpu"]
    assert len(gpus) == 8
    for g in gpus:
        nb = _neighbours(d, g)
        assert "nvswitch" in nb
        (sw,) = [n for n in nb if d["nodes"][n]["kind"] == "pcie_switch"]
        kinds = {d["nodes"][n]["kind"] for n in _neighbours(d, sw)}
        assert {"cpu", "nic", "gpu"} <= kinds
    assert sum(v["kind"] == "cpu" for v in d["nodes"].values()) == 2
    # one compute NIC per GPU (DGX A100: 8 x 200 Gb/s), beside its GPU on the same PCIe switch
    assert sum(v["kind"] == "nic" for v in d["nodes"].values()) == 8
    for g in range(8):
        assert _neighbours(d, f"nic{g}") & _neighbours(d, f"gpu{g}")


@pytest.mark.parametrize("over", [1, 3])
def test_rail_optimized_wiring_and_oversubscription(over):
    d = t.rail_optimized(n_servers=3, gpus_per_server=4, oversubscription=over)
    for g in range(4):   # rail g: GPU g of every server, and nothing else, below leaf g
        assert _neighbours(d, f"leaf{g}") - {f"spine{k}" for k in range(3)} == {f"s{s}g{g}" for s in range(3)}
        ups = [e for e in d["edges"] if e["kind"] == "uplink" and f"leaf{g}" in (e["a"], e["b"])]
        assert len(ups) == 3 // over               # downlinks / uplinks = the oversubscription ratio
    assert ("non-blocking" in d["title"]) == (over == 1)
    with pytest.raises(ValueError):
        t.rail_optimized(n_servers=3, oversubscription=2)


def test_one_server_fans_out_over_rails():
    d = t.server_rails(8)
    for g in range(8):   # GPU g -> its NIC g -> leaf g, and leaf g reaches no other NIC of this server
        assert _neighbours(d, f"nic{g}") == {f"gpu{g}", f"leaf{g}"}
        assert _neighbours(d, f"leaf{g}") == {f"nic{g}"}
    assert sum(v["kind"] == "tor" for v in d["nodes"].values()) == 8
    # the ToR pictures say which design they are, so they are not read as the rail-optimized one
    assert "one ToR per rack" in t.rack(4)["title"] and "general-purpose" in t.rack(4)["title"]
    assert "one ToR per rack" in t.cluster()["title"]
    assert "rail" in t.server_rails()["title"] and "ToR" not in t.server_rails()["title"]


def test_rack_and_cluster_wiring():
    r = t.rack(5)
    assert _neighbours(r, "tor0") == {f"r0s{i}" for i in range(5)}
    c = t.cluster(n_racks=3, servers_per_rack=2, n_spines=2)
    for k in range(2):
        assert _neighbours(c, f"spine{k}") == {"tor0", "tor1", "tor2"}   # leaf-spine: every ToR on every spine
    assert sum(v["kind"] == "server" for v in c["nodes"].values()) == 6
    assert len(c["groups"]) == 3


def test_ps_vs_all_reduce():
    ps = t.parameter_server(4)
    assert _neighbours(ps, "ps0") == {"w0", "w1", "w2", "w3"}
    ring = t.ring_all_reduce(5)
    assert "decentralized" not in ring["title"]            # the course keeps that word for gossip (notebook 11)
    assert all(len(_neighbours(ring, f"w{i}")) == 2 for i in range(5))
    assert not any(v["kind"] == "ps" for v in ring["nodes"].values())


@pytest.mark.parametrize("desc", [t.server_8gpu(), t.rack(), t.cluster(), t.parameter_server(), t.ring_all_reduce(),
                                  t.server_rails(),
                                  t.rail_optimized(), t.rail_optimized(oversubscription=3)])
def test_every_description_draws(desc):
    ax = t.draw(desc)
    n_boxes = len(ax.patches) - len(desc.get("groups", []))
    assert n_boxes == len(desc["nodes"])
    assert len(ax.lines) == len(desc["edges"])
    plt.close(ax.figure)


def test_side_by_side():
    fig = t.draw_side_by_side(t.parameter_server(), t.ring_all_reduce())
    assert len(fig.axes) == 2
    plt.close(fig)
    fig = t.draw_side_by_side(t.rail_optimized(), t.rail_optimized(oversubscription=3), rows=2)
    assert len(fig.axes) == 2 and fig.axes[0].get_position().y0 > fig.axes[1].get_position().y0
    plt.close(fig)
