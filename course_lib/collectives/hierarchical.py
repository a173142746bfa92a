"""Hierarchical (2-D) all-reduce from the ring's two halves: inside each node, across nodes on a 1/g shard, inside.

Mikami et al., "Massively Distributed SGD", arXiv:1811.05233, 2018 (2D-Torus all-reduce: reduce-scatter along one
dimension, all-reduce along the other, all-gather along the first); taught in
notebooks/06_build_your_own_collectives.ipynb, its cost in course_lib.costs.alpha_beta.hierarchical_allreduce.
Ranks node*g .. node*g + g-1 form node `node` (g = per_node, as torchrun numbers them). Three phases:
1. ring reduce-scatter among the g ranks of each node: local rank i ends with shard i summed over its node;
2. ring all-reduce of shard i among rank i of every node: shard i is now summed over all p ranks;
3. ring all-gather among the g ranks of each node: every rank holds every shard.
Only phase 2 crosses nodes, and on each of the g parallel rings it carries n/g, not n.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .p2p import Traffic, finish, flat_work
from .ring import _all_gather, _reduce_scatter, chunk_bounds
from .trace import Trace


def _relabel(trace: Trace | None, since: int, phase: str) -> None:
    """Name the steps recorded since `since` after the hierarchical phase they belong to."""
    if trace is not None:
        for step in trace.steps[since:]:
            step["phase"] = phase


def hierarchical_all_reduce(tensor: torch.Tensor, per_node: int, op="sum", traffic: Traffic | None = None,
                            trace: Trace | None = None) -> torch.Tensor:
    """In-place all-reduce in three ring phases over nodes of `per_node` ranks; same result as dist.all_reduce."""
    rank, p = dist.get_rank(), dist.get_world_size()
    if per_node < 1 or p % per_node:
        raise ValueError(f"the world size {p} must be a whole number of nodes of per_node={per_node} ranks")
    nodes = p // per_node
    node, local = divmod(rank, per_node)
    in_node = [node * per_node + i for i in range(per_node)]          # the GPUs of my node
    across = [k * per_node + local for k in range(nodes)]             # GPU `local` of every node
    flat = flat_work(tensor)
    shards = chunk_bounds(flat.numel(), per_node)
    if trace is not None:
        trace.begin("hierarchical all-reduce", rank, p, shards, flat)

    since = len(trace.steps) if trace is not None else 0
    _reduce_scatter(flat, shards, op, traffic, trace, members=in_node)
    _relabel(trace, since, "in-node reduce-scatter")

    lo, hi = shards[local]
    shard = flat[lo:hi]                                               # summed over my node; now over all nodes
    pieces = chunk_bounds(hi - lo, nodes)
    counter = traffic if traffic is not None else Traffic()          # counts the arrow's bytes when tracing
    before = counter.bytes_sent
    if nodes > 1 and hi > lo:
        _reduce_scatter(shard, pieces, op, counter, None, members=across)
        _all_gather(shard, pieces, counter, None, members=across)
    if trace is not None:
        i = across.index(rank)
        right = across[(i + 1) % nodes]
        moved = counter.bytes_sent - before
        trace.record("all-reduce across nodes", [(rank, right, local, moved)] if moved else [], flat)

    since = len(trace.steps) if trace is not None else 0
    _all_gather(flat, shards, traffic, trace, members=in_node)
    _relabel(trace, since, "in-node all-gather")
    return finish(tensor, flat)
