"""The one table of torch.distributed's collectives: their Python names, their c10d operators, and the size S of each.

A learner can call a collective as ``dist.all_reduce``, through the ProcessGroup object (``group.allreduce([t])``),
``torch.distributed._functional_collectives`` or ``torch.ops.c10d.allreduce_``: all of them pass through one of
the dispatcher operators below (torch 2.13, torch/csrc/distributed/c10d/Ops.cpp and Functional.cpp). Every
instrument and checker reads this table: recorder.py turns each call into one event (CommLog's sizes, AllToAllLog's
bytes, checks/watch.py's messages), checks/switch_off.py stops what an exercise forbids;
tests/test_training_comm_log.py checks that every operator and Python function of torch.distributed is in it or in
NOT_RECORDED. Sizes follow nccl-tests (PERFORMANCE.md): an all-reduce or broadcast of S bytes, an all-gather or
gather whose *result* is S, a reduce-scatter or scatter whose *input* is S.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Where S lies in an operator's arguments (args are the operator's tensor arguments, lists included):
#   "first"          the first argument (a tensor or a list of them, summed): all-reduce, broadcast, coalesced forms
#   "second"         the second argument: the input of a single-tensor reduce-scatter
#   "out_list"       the first argument's first list (the p outputs of one input): the list all-gather
#   "in_list"        the second argument's first list (the p inputs of one output): the list reduce-scatter
#   "first_times_p"  the first argument times the group size: functional all-gather, scatter's received piece
#   "second_times_p" the second argument times the group size: gather's sent piece
#   None             not a size-S collective: point-to-point, recorded per message (recorder.py)
#
# collective -> (names in torch.distributed, {dispatcher operator "namespace.name" without overload: where S lies})
COLLECTIVES: dict[str, tuple[tuple[str, ...], dict[str, str | None]]] = {
    "all_reduce": (("all_reduce",),
                   {"c10d.allreduce_": "first", "_c10d_functional.all_reduce": "first",
                    "_c10d_functional.all_reduce_": "first"}),
    # several tensors in one call: torch's own bucketed all-reduce (notebook 09 builds buckets by hand)
    "all_reduce_coalesced": (("all_reduce_coalesced",),
                             {"c10d.allreduce_coalesced_": "first", "_c10d_functional.all_reduce_coalesced": "first",
                              "_c10d_functional.all_reduce_coalesced_": "first"}),
    "broadcast": (("broadcast", "broadcast_object_list"),
                  {"c10d.broadcast_": "first", "_c10d_functional.broadcast": "first",
                   "_c10d_functional.broadcast_": "first"}),
    "reduce": (("reduce",), {"c10d.reduce_": "first"}),
    "all_gather": (("all_gather", "all_gather_object", "all_gather_coalesced"),
                   {"c10d.allgather_": "out_list", "c10d.allgather_coalesced_": "first"}),
    # the single-tensor all-gather (one output buffer p times the input), what ZeRO and FSDP use
    "all_gather_single": (("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
                          {"c10d._allgather_base_": "first", "c10d.allgather_into_tensor_coalesced_": "first",
                           "_c10d_functional.all_gather_into_tensor": "first_times_p",
                           "_c10d_functional.all_gather_into_tensor_out": "first_times_p",
                           "_c10d_functional.all_gather_into_tensor_coalesced": "first_times_p"}),
    "reduce_scatter": (("reduce_scatter",), {"c10d.reduce_scatter_": "in_list"}),
    "reduce_scatter_single": (("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"),
                              {"c10d._reduce_scatter_base_": "second",
                               "c10d.reduce_scatter_tensor_coalesced_": "second",
                               "_c10d_functional.reduce_scatter_tensor": "first",
                               "_c10d_functional.reduce_scatter_tensor_out": "first",
                               "_c10d_functional.reduce_scatter_tensor_coalesced": "first"}),
    "gather": (("gather", "gather_object"), {"c10d.gather_": "second_times_p"}),
    "scatter": (("scatter", "scatter_object_list"), {"c10d.scatter_": "first_times_p"}),
    "all_to_all": (("all_to_all", "all_to_all_single"),
                   {"c10d.alltoall_": "second", "c10d.alltoall_base_": "first",
                    "_c10d_functional.all_to_all_single": "first", "_dtensor.shard_dim_alltoall": "first"}),
    "send_recv": (("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list"),
                  {"c10d.send": None, "c10d.recv_": None, "c10d.recv_any_source_": None,
                   "_c10d_functional.isend": None, "_c10d_functional.irecv": None,
                   "_c10d_functional.batch_p2p_ops": None}),
}

# What torch.distributed has that moves no data between ranks, or is not a call a rank makes to move it: not recorded.
NOT_RECORDED = {
    "c10d.barrier": "a barrier moves no data; it stays available to every exercise",
    "c10d.monitored_barrier_": "a barrier moves no data",
    "c10d.check_for_nan": "a local check of a tensor, no communication",
    "_c10d_functional.wait_tensor": "waits for a functional collective already recorded when it was issued",
    "_c10d_functional._wrap_tensor_autograd": "wraps a tensor for autograd, no communication",
    "_dtensor.mesh_get_process_group": "looks up a device mesh's group, no communication",
    # differentiable functional collectives: their forward calls the _c10d_functional operator of the same name,
    # which is recorded; recording both would count each call twice
    "_c10d_functional_autograd.all_gather_into_tensor": "its forward is _c10d_functional.all_gather_into_tensor",
    "_c10d_functional_autograd.reduce_scatter_tensor": "its forward is _c10d_functional.reduce_scatter_tensor",
    "_c10d_functional_autograd.all_to_all_single": "its forward is _c10d_functional.all_to_all_single",
    "symm_mem": "the whole namespace: CUDA symmetric-memory kernels, which no gloo rank and no lesson reaches",
    "barrier": "moves no data", "monitored_barrier": "moves no data",
}

# Every collective that moves data between ranks (a barrier moves none and stays available).
ALL_COLLECTIVES = tuple(k for k in COLLECTIVES if k != "send_recv")
OP_TO_COLLECTIVE = {op: name for name, (_, ops) in COLLECTIVES.items() for op in ops}
SENDS = ("c10d.send", "_c10d_functional.isend")
RECVS = ("c10d.recv_", "c10d.recv_any_source_", "_c10d_functional.irecv")


def family(collective: str) -> str:
    """all_gather for all_gather_single, all_reduce for all_reduce_coalesced: the algorithm's name, for ring bytes."""
    return collective.removesuffix("_single").removesuffix("_coalesced")


def op_key(func) -> str:
    """'c10d.allreduce_' for the dispatcher operator c10d::allreduce_ (any overload)."""
    return f"{func.namespace}.{func.__name__.split('.')[0]}"


def nbytes(x) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list or tuple; 0 for anything else."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(nbytes(v) for v in x)
    return 0


def group_of(args):
    """The process group an operator's arguments name: a boxed ProcessGroup, or a functional collective's group
    name; None when they name none (the default group)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:  # a ReduceOp or an options object, not the group
                continue
    for a in args:
        if isinstance(a, str):
            try:
                return dist.distributed_c10d._resolve_process_group(a)
            except (RuntimeError, ValueError, KeyError):
                continue
    return None


def size_of(op: str, tensors: list, p: int) -> int | None:
    """S in bytes for one call of ``op`` (its tensor arguments ``tensors``, group size ``p``); None if not sized."""
    where = COLLECTIVES[OP_TO_COLLECTIVE[op]][1][op] if op in OP_TO_COLLECTIVE else None
    if where is None or not tensors:
        return None
    nested = lambda x: x[0] if x and isinstance(x[0], list) else x  # noqa: E731 (one input's list of p tensors)
    return {"first": lambda: nbytes(tensors[0]), "second": lambda: nbytes(tensors[1]),
            "out_list": lambda: nbytes(nested(tensors[0])), "in_list": lambda: nbytes(nested(tensors[1])),
            "first_times_p": lambda: nbytes(tensors[0]) * p, "second_times_p": lambda: nbytes(tensors[1]) * p}[where]()


def everything_but(*kept: str) -> tuple[str, ...]:
    """Every collective and send/recv except `kept`: what an exercise about one collective switches off."""
    unknown = set(kept) - set(COLLECTIVES)
    if unknown:
        raise ValueError(f"unknown collective(s) {sorted(unknown)}: use names from {sorted(COLLECTIVES)}")
    return tuple(k for k in COLLECTIVES if k not in kept)


def expand(names) -> tuple[str, ...]:
    """Check collective names against the table; "all" stands for every collective except send/recv."""
    out = []
    for n in ([names] if isinstance(names, str) else list(names)):
        if n == "all":
            out += ALL_COLLECTIVES
        elif n in COLLECTIVES:
            out.append(n)
        else:
            raise ValueError(f"unknown collective {n!r}: use 'all' or one of {sorted(COLLECTIVES)}")
    return tuple(dict.fromkeys(out))
