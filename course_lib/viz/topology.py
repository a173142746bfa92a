"""Cluster drawings generated from a topology description: a server, a rack behind one ToR, such racks + spines, a
server's NICs on rails, a rail-optimized fabric, parameter server vs all-reduce (no server).

Taught in notebooks/02_cluster_architecture.ipynb. A description is plain data:
``{"title", "nodes": {id: {"kind", "label", "xy", "w"?}}, "edges": [{"a", "b", "kind"}], "groups": [...],
"legend": {edge_kind: text}}``; the builders below make one, `draw` turns any description into a figure.
Bandwidth labels are handed in by the caller (from data/links.csv), never typed here.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Rectangle

NODE_COLORS = {"gpu": "#76b900", "cpu": "#4c72b0", "pcie_switch": "#8da0cb", "nic": "#fc8d62", "nvswitch": "#2ca02c",
               "tor": "#e78ac3", "spine": "#d62728", "server": "#dddddd", "ps": "#9467bd", "worker": "#76b900"}
EDGE_STYLES = {"nvlink": ("#2ca02c", 2.5, "-"), "pcie": ("#4c72b0", 1.5, "-"), "cpu_link": ("#555555", 1.5, ":"),
               "network": ("#fc8d62", 1.5, "-"), "uplink": ("#d62728", 1.5, "-"), "push_pull": ("#9467bd", 1.5, "-"),
               "ring": ("#2ca02c", 2.0, "-")}


def _node(kind, label, x, y, w=0.7):
    return {"kind": kind, "label": label, "xy": (x, y), "w": w}


def server_8gpu(nvlink_label: str = "NVLink via NVSwitch", pcie_label: str = "PCIe",
                nic_label: str = "NIC to the network", name: str = "one 8-GPU server (HGX/DGX style)") -> dict:
    """8 GPUs all-to-all through NVSwitch; one compute NIC per GPU (DGX A100: 8 x 200 Gb/s, DGX H100: 8 x 400 Gb/s),
    a GPU pair and its two NICs on each PCIe switch; 4 switches on 2 CPUs."""
    nodes, edges = {}, []
    nodes["cpu0"], nodes["cpu1"] = _node("cpu", "CPU 0", 1.5, 3.55, 0.85), _node("cpu", "CPU 1", 5.5, 3.55, 0.85)
    nodes["net"] = _node("tor", "to the first switches (section 2)", 3.5, 5.1, 8.0)
    edges.append({"a": "cpu0", "b": "cpu1", "kind": "cpu_link"})
    for i in range(4):
        sw = f"sw{i}"
        nodes[sw] = _node("pcie_switch", "PCIe sw", 2 * i + 0.5, 2.9, 0.8)
        edges.append({"a": f"cpu{i // 2}", "b": sw, "kind": "pcie"})
        for g in (2 * i, 2 * i + 1):
            nodes[f"nic{g}"] = _node("nic", f"NIC {g}", g, 4.2, 0.7)
            nodes[f"gpu{g}"] = _node("gpu", f"GPU {g}", g, 1.8, 0.8)
            edges += [{"a": sw, "b": f"nic{g}", "kind": "pcie"}, {"a": f"nic{g}", "b": "net", "kind": "network"},
                      {"a": sw, "b": f"gpu{g}", "kind": "pcie"}]
    nodes["nvswitch"] = _node("nvswitch", "NVSwitch (all-to-all)", 3.5, 0.6, 8.0)
    edges += [{"a": f"gpu{g}", "b": "nvswitch", "kind": "nvlink"} for g in range(8)]
    return {"title": name, "nodes": nodes, "edges": edges, "groups": [],
            "legend": {"nvlink": nvlink_label, "pcie": pcie_label, "cpu_link": "CPU-CPU link",
                       "network": nic_label}}


def rack(n_servers: int = 4, gpus_per_server: int = 8, link_label: str = "every NIC of a server to the ToR",
         x0: float = 0.0, idx: int = 0) -> dict:
    """One ToR per rack, the general-purpose design: n servers, all of whose NICs go to the rack's top-of-rack (ToR)
    switch (drawn as one line per server). Some AI clusters keep it (Llama 3's: 16 GPUs per ToR); NVIDIA's reference
    designs for AI clusters are rail-optimized instead (server_rails, rail_optimized): NIC i of every server to
    leaf i."""
    nodes, edges = {}, []
    tor = f"tor{idx}"
    nodes[tor] = _node("tor", f"ToR {idx}", x0 + (n_servers - 1) / 2, 1.3, 1.0)
    for s in range(n_servers):
        sid = f"r{idx}s{s}"
        nodes[sid] = _node("server", "server", x0 + s, 0, 0.85)
        edges.append({"a": sid, "b": tor, "kind": "network"})
    title = (f"one ToR per rack (the general-purpose design): {n_servers} servers of {gpus_per_server} GPUs behind "
             "one top-of-rack switch")
    return {"title": title, "nodes": nodes, "edges": edges,
            "groups": [{"label": f"rack {idx}", "members": list(nodes)}], "legend": {"network": link_label}}


def cluster(n_racks: int = 3, servers_per_rack: int = 3, n_spines: int = 2, gpus_per_server: int = 8,
            server_link_label: str = "a server's NICs to its ToR", uplink_label: str = "ToR to spine") -> dict:
    """One ToR per rack, racks joined by spine switches: every ToR has a link to every spine (leaf-spine)."""
    nodes, edges, groups = {}, [], []
    gap = servers_per_rack + 0.8
    for r in range(n_racks):
        part = rack(servers_per_rack, gpus_per_server, x0=r * gap, idx=r)
        nodes.update(part["nodes"])
        edges += part["edges"]
        groups += part["groups"]
    width = n_racks * gap - 0.8 - 1
    for k in range(n_spines):
        x = width / 2 if n_spines == 1 else width * (0.2 + 0.6 * k / (n_spines - 1))
        nodes[f"spine{k}"] = _node("spine", f"spine {k}", x, 2.8, 1.0)
        edges += [{"a": f"tor{r}", "b": f"spine{k}", "kind": "uplink"} for r in range(n_racks)]
    return {"title": f"one ToR per rack, in a cluster: {n_racks} racks of {servers_per_rack} servers "
                     f"({gpus_per_server} GPUs each), every ToR on each of {n_spines} spines", "nodes": nodes,
            "edges": edges, "groups": groups, "legend": {"network": server_link_label, "uplink": uplink_label}}


def server_rails(gpus_per_server: int = 8, nic_label: str = "NIC i to leaf i (rail i)",
                 pcie_label: str = "GPU to its own NIC (PCIe switch)") -> dict:
    """One server fanned out over rails: GPU i's NIC goes to leaf switch i, so the server touches gpus_per_server
    different leaves, and NIC i of every other server goes to the same leaf i."""
    nodes, edges, members = {}, [], []
    for g in range(gpus_per_server):
        nodes[f"gpu{g}"] = _node("gpu", f"GPU {g}", g, 0, 0.8)
        nodes[f"nic{g}"] = _node("nic", f"NIC {g}", g, 1.0, 0.8)
        nodes[f"leaf{g}"] = _node("tor", f"leaf {g}", g, 2.5, 0.8)
        members += [f"gpu{g}", f"nic{g}"]
        edges += [{"a": f"gpu{g}", "b": f"nic{g}", "kind": "pcie"},
                  {"a": f"nic{g}", "b": f"leaf{g}", "kind": "network"}]
    return {"title": f"rail-optimized: one server's {gpus_per_server} NICs on {gpus_per_server} rails "
                     "(leaf i = rail i)", "nodes": nodes, "edges": edges,
            "groups": [{"label": "one server (every other server is wired the same way)", "members": members}],
            "legend": {"pcie": pcie_label, "network": nic_label}}


def rail_optimized(n_servers: int = 3, gpus_per_server: int = 4, oversubscription: int = 1,
                   nic_label: str = "each GPU's NIC to its rail's leaf", uplink_label: str = "leaf to spine") -> dict:
    """A rail-optimized two-level fabric: NIC i of every server goes to leaf switch i (rail i), and every leaf has
    n_servers / oversubscription uplinks spread over the spines (1 = non-blocking: as much up as down)."""
    if n_servers % oversubscription:
        raise ValueError("oversubscription must divide the servers per leaf (downlinks / uplinks)")
    nodes, edges, groups = {}, [], []
    uplinks = n_servers // oversubscription
    width = n_servers * (gpus_per_server + 1) - 1
    for s in range(n_servers):
        x0 = s * (gpus_per_server + 1)
        members = []
        for g in range(gpus_per_server):
            gid = f"s{s}g{g}"
            nodes[gid] = _node("gpu", f"GPU{g}", x0 + g, 0, 0.85)
            members.append(gid)
        groups.append({"label": f"server {s}", "members": members})
    for g in range(gpus_per_server):
        leaf = f"leaf{g}"
        nodes[leaf] = _node("tor", f"leaf {g} = rail {g}", (g + 0.5) * (width + 1) / gpus_per_server - 0.5, 2.4, 2.0)
        edges += [{"a": f"s{s}g{g}", "b": leaf, "kind": "network"} for s in range(n_servers)]
    for k in range(uplinks):
        nodes[f"spine{k}"] = _node("spine", f"spine {k}", (k + 0.5) * (width + 1) / uplinks - 0.5, 4.4, 1.3)
    for g in range(gpus_per_server):
        edges += [{"a": f"leaf{g}", "b": f"spine{k}", "kind": "uplink"} for k in range(uplinks)]
    kind = "non-blocking (1:1)" if oversubscription == 1 else f"oversubscribed {oversubscription}:1"
    return {"title": f"rail-optimized, {kind}: every leaf has {n_servers} links down and {uplinks} up",
            "nodes": nodes, "edges": edges, "groups": groups,
            "legend": {"network": nic_label, "uplink": uplink_label}}


def parameter_server(n_workers: int = 4, n_servers: int = 1) -> dict:
    """Centralized: every worker pushes gradients to the parameter server(s) and pulls parameters back."""
    nodes, edges = {}, []
    for k in range(n_servers):
        nodes[f"ps{k}"] = _node("ps", "parameter\nserver" if n_servers == 1 else f"PS {k}",
                                (n_workers - 1) * (k + 1) / (n_servers + 1), 1.6, 1.4)
    for w in range(n_workers):
        nodes[f"w{w}"] = _node("worker", f"worker {w}", w, 0, 0.8)
        edges += [{"a": f"w{w}", "b": f"ps{k}", "kind": "push_pull"} for k in range(n_servers)]
    return {"title": "parameter server (centralized)", "nodes": nodes, "edges": edges, "groups": [],
            "legend": {"push_pull": "push gradients / pull parameters"}}


def ring_all_reduce(n_workers: int = 4) -> dict:
    """All-reduce with no server: workers average gradients by passing chunks around a ring, and all end with the
    same global average. (Not "decentralized": the course keeps that word for gossip, notebook 11.)"""
    nodes, r = {}, (n_workers - 1) / 2
    for w in range(n_workers):
        a = math.pi / 2 - 2 * math.pi * w / n_workers
        nodes[f"w{w}"] = _node("worker", f"worker {w}", r + r * math.cos(a), 0.8 + 0.8 * math.sin(a), 0.8)
    edges = [{"a": f"w{w}", "b": f"w{(w + 1) % n_workers}", "kind": "ring"} for w in range(n_workers)]
    return {"title": "all-reduce, no server (ring)", "nodes": nodes, "edges": edges, "groups": [],
            "legend": {"ring": "send to the next worker on the ring"}}


def _end(node, other):
    """Where an edge meets a node: the node's centre, or straight above/below the other end for wide bars."""
    (x, y), (ox, _) = node["xy"], other["xy"]
    return (ox, y) if node["w"] > 3 else (x, y)


def draw(desc: dict, ax=None, box_h: float = 0.42):
    """Draw one topology description on ax (a new small figure if None); returns the axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    nodes = desc["nodes"]
    for e in desc["edges"]:
        a, b = nodes[e["a"]], nodes[e["b"]]
        (x1, y1), (x2, y2) = _end(a, b), _end(b, a)
        color, lw, ls = EDGE_STYLES[e["kind"]]
        ax.plot([x1, x2], [y1, y2], color=color, lw=lw, ls=ls, zorder=1)
    for n in nodes.values():
        x, y = n["xy"]
        ax.add_patch(FancyBboxPatch((x - n["w"] / 2, y - box_h / 2), n["w"], box_h, boxstyle="round,pad=0.02",
                                    fc=NODE_COLORS[n["kind"]], ec="black", lw=0.8, zorder=2))
        ax.text(x, y, n["label"], ha="center", va="center", fontsize=7, zorder=3)
    for g in desc.get("groups", []):
        xs = [nodes[m]["xy"][0] for m in g["members"]]
        ys = [nodes[m]["xy"][1] for m in g["members"]]
        x0, x1, y0, y1 = min(xs) - 0.55, max(xs) + 0.55, min(ys) - 0.45, max(ys) + 0.45
        ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, ls="--", ec="gray", lw=0.8, zorder=0))
        # below the box: above it the nodes' links would cross the label
        ax.text(x0 + 0.05, y0 - 0.05, g["label"], fontsize=7, color="gray", va="top")
        ax.update_datalim([(x0, y0 - 0.35)])
    used = {e["kind"] for e in desc["edges"]}
    handles = [plt.Line2D([], [], color=EDGE_STYLES[k][0], lw=EDGE_STYLES[k][1], ls=EDGE_STYLES[k][2], label=t)
               for k, t in desc.get("legend", {}).items() if k in used]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2,
                  frameon=False)
    ax.set_title(desc["title"], fontsize=9)
    ax.set_aspect("equal")
    ax.autoscale_view()
    ax.margins(0.08)
    ax.axis("off")
    return ax


def draw_side_by_side(*descs, figsize=(9, 3.2), rows: int = 1):
    """Several descriptions in one row, or stacked (rows=len(descs)); returns the figure."""
    fig, axes = plt.subplots(rows, len(descs) // rows, figsize=figsize, dpi=100)
    axes = getattr(axes, "flat", axes)
    for d, ax in zip(descs, [axes] if len(descs) == 1 else list(axes)):
        draw(d, ax)
    fig.tight_layout()
    return fig
