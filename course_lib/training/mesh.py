"""Composing parallelisms on a device mesh: each dimension's groups, FSDP2 x tensor parallel and HSDP training, and
a published layout placed on nodes (notebooks 15 and 15b).

torch's DeviceMesh (torch.distributed.device_mesh.init_device_mesh) lays the ranks out row-major over the mesh
shape: the LAST dimension varies fastest, so its groups are consecutive ranks, which a launcher places on the same
node. That is why the dimension with the heaviest traffic (tensor parallel) goes last (PyTorch's 2-D parallel
tutorial, "Large Scale Transformer model training with Tensor Parallel"; Llama 3, Dubey et al. 2024, section
3.3.2: dimensions ordered [TP, CP, PP, DP] from the innermost). FSDP2's fully_shard shards over one mesh dimension
(Zhao et al. 2023) or, given a 2-D mesh, replicates over the first and shards over the second (HSDP).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from .data import load_digits, worker_batch
from .model import make_mlp


def mesh_groups(shape: tuple[int, ...], dim: int) -> list[list[int]]:
    """The groups of ranks along mesh dimension `dim` for ranks laid out row-major over `shape` (init_device_mesh's
    layout): the ranks that differ only in their coordinate on `dim`, each group in increasing order."""
    ranks = torch.arange(math.prod(shape)).reshape(shape)
    return ranks.movedim(dim, -1).reshape(-1, shape[dim]).tolist()


def coordinate(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A rank's coordinate on a row-major mesh (what DeviceMesh.get_coordinate() returns)."""
    return tuple(int(c) for c in torch.unravel_index(torch.tensor(rank), shape))


def place_on_nodes(degrees: dict[str, int], gpus_per_node: int) -> dict[str, dict]:
    """Where each parallel dimension's groups fall when ranks are numbered with the FIRST key of `degrees` varying
    fastest (innermost) and gpus_per_node consecutive ranks share a node: per dimension, its size, its number of
    groups, how many nodes one group spans and how far apart (in nodes) its members sit."""
    names = list(degrees)
    shape = tuple(degrees[n] for n in reversed(names))          # row-major: the innermost dimension last
    out = {}
    for i, name in enumerate(names):
        dim = len(names) - 1 - i
        first = mesh_groups(shape, dim)[0]
        nodes = sorted({r // gpus_per_node for r in first})
        stride = math.prod(degrees[n] for n in names[:i])       # rank distance between neighbours in a group
        out[name] = {"size": degrees[name], "groups": math.prod(shape) // degrees[name], "nodes_spanned": len(nodes),
                     "rank_stride": stride, "node_stride": stride / gpus_per_node,
                     "inside_a_node": len(nodes) == 1}
    return out


def mesh_train(kind: str, steps: int = 5, batch_size: int = 16, lr: float = 0.1, hidden: int = 64,
               dtype: torch.dtype = torch.float64) -> dict:
    """Run on 4 ranks (the library copy of notebook 15's cells): the digits MLP trained with SGD on a 2 x 2 mesh,
    kind "fsdp_tp" (FSDP2 over "dp", tensor parallel fc1/fc2 over "tp") or "hsdp" (replicate x shard). Every
    data-parallel rank takes its own batch; returns the full parameters, flat, and this rank's groups."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if dist.get_world_size() != 4:
        raise ValueError(f"mesh_train lays 4 ranks out as 2 x 2; it was started on {dist.get_world_size()}")
    names = ("dp", "tp") if kind == "fsdp_tp" else ("replicate", "shard")
    mesh = init_device_mesh(device().type, (2, 2), mesh_dim_names=names)
    model = make_mlp(hidden, dtype=dtype).to(device())
    if kind == "fsdp_tp":
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        worker, workers = mesh["dp"].get_local_rank(), 2       # the two TP ranks of a replica see the same batch
    elif kind == "hsdp":
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        worker, workers = dist.get_rank(), 4                   # every rank is a data-parallel worker
    else:
        raise ValueError(f"kind is 'fsdp_tp' or 'hsdp', not {kind!r}")
    x, y = load_digits()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        xb, yb = worker_batch(x.to(dtype), y, worker, workers, batch_size, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb.to(device())), yb.to(device())).backward()
        opt.step()
    full = torch.cat([q.full_tensor().reshape(-1) for q in model.parameters()]).detach().cpu()
    groups = {n: dist.get_process_group_ranks(mesh[n].get_group()) for n in names}
    return {"params": full, "groups": groups, "coordinate": tuple(mesh.get_coordinate()),
            "placements": [str(q.placements) for q in model.parameters()]}
