"""Two 8-GPU nodes as the cross-node all-reduce sees them: inside a node every GPU reaches the others through
NVSwitch; out of the node each GPU has only its own NIC, and every NIC goes to one switch.

Taught in notebooks/17_multi_node_lab.ipynb, beside the table of NVLink against NIC speeds. It builds a description
for course_lib.viz.topology.draw; the bandwidth labels are handed in by the caller (from data/links.csv).
"""

from __future__ import annotations

from .topology import _node, draw


def two_nodes(nvlink_label: str, nic_label: str, gpus: int = 8, ax=None):
    """Draw two nodes of ``gpus`` GPUs, their NVSwitch, one NIC per GPU and one switch between the nodes; returns
    the axes."""
    nodes, edges, groups = {}, [], []
    gap = gpus + 1.0
    for s in range(2):
        x0, members = s * gap, []
        nodes[f"nvs{s}"] = _node("nvswitch", "NVSwitch", x0 + (gpus - 1) / 2, 0.6, gpus - 0.2)
        for g in range(gpus):
            gpu, nic = f"n{s}gpu{g}", f"n{s}nic{g}"
            nodes[gpu] = _node("gpu", f"GPU {g}", x0 + g, 1.6, 0.8)
            nodes[nic] = _node("nic", f"NIC {g}", x0 + g, 2.6, 0.8)
            edges += [{"a": gpu, "b": f"nvs{s}", "kind": "nvlink"}, {"a": gpu, "b": nic, "kind": "pcie"},
                      {"a": nic, "b": "switch", "kind": "network"}]
            members += [gpu, nic]
        groups.append({"label": f"node {s}", "members": [f"nvs{s}", *members]})
    nodes["switch"] = _node("tor", "switch (InfiniBand)", (gap + gpus - 1) / 2, 4.2, 3.0)   # midway between the nodes
    desc = {"title": f"two nodes of {gpus} GPUs: NVLink inside a node, one NIC per GPU between nodes",
            "nodes": nodes, "edges": edges, "groups": groups,
            "legend": {"nvlink": nvlink_label, "pcie": "GPU to its own NIC (PCIe)", "network": nic_label}}
    return draw(desc, ax)
