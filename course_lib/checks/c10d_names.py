"""Every way a rank can reach each collective: its torch.distributed names and the c10d operators it ends in.

A learner can call a collective as ``dist.all_reduce``, ``dist.distributed_c10d.all_reduce``, through the
ProcessGroup object (``group.allreduce([t])``), ``torch.distributed._functional_collectives`` or
``torch.ops.c10d.allreduce_``: all of them pass through one of the dispatcher operators below (torch 2.13,
torch/csrc/distributed/c10d/Ops.cpp and Functional.cpp), which is where switch_off.py stops them and traffic.py
counts them. The Python names are switched off too, so the usual call fails with the usual name in its message.
"""

from __future__ import annotations

# collective -> (names in torch.distributed, dispatcher operators "namespace.name" without the overload)
COLLECTIVES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "all_reduce": (("all_reduce",),
                   ("c10d.allreduce_", "_c10d_functional.all_reduce", "_c10d_functional.all_reduce_")),
    # several tensors in one call: torch's own bucketed all-reduce, what exercise 9.2 builds
    "all_reduce_coalesced": (("all_reduce_coalesced",),
                             ("c10d.allreduce_coalesced_", "_c10d_functional.all_reduce_coalesced",
                              "_c10d_functional.all_reduce_coalesced_")),
    "broadcast": (("broadcast", "broadcast_object_list"),
                  ("c10d.broadcast_", "_c10d_functional.broadcast", "_c10d_functional.broadcast_")),
    "reduce": (("reduce",), ("c10d.reduce_",)),
    "all_gather": (("all_gather", "all_gather_object", "all_gather_coalesced"),
                   ("c10d.allgather_", "c10d.allgather_coalesced_")),
    # the single-tensor all-gather (one output buffer p times the input), what ZeRO and FSDP use
    "all_gather_single": (("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
                          ("c10d._allgather_base_", "c10d.allgather_into_tensor_coalesced_",
                           "_c10d_functional.all_gather_into_tensor", "_c10d_functional.all_gather_into_tensor_out",
                           "_c10d_functional.all_gather_into_tensor_coalesced")),
    "reduce_scatter": (("reduce_scatter",), ("c10d.reduce_scatter_",)),
    "reduce_scatter_single": (("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"),
                              ("c10d._reduce_scatter_base_", "c10d.reduce_scatter_tensor_coalesced_",
                               "_c10d_functional.reduce_scatter_tensor",
                               "_c10d_functional.reduce_scatter_tensor_out",
                               "_c10d_functional.reduce_scatter_tensor_coalesced")),
    "gather": (("gather", "gather_object"), ("c10d.gather_",)),
    "scatter": (("scatter", "scatter_object_list"), ("c10d.scatter_",)),
    "all_to_all": (("all_to_all", "all_to_all_single"),
                   ("c10d.alltoall_", "c10d.alltoall_base_", "_c10d_functional.all_to_all_single",
                    "_dtensor.shard_dim_alltoall")),
    "send_recv": (("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list"),
                  ("c10d.send", "c10d.recv_", "c10d.recv_any_source_", "_c10d_functional.isend",
                   "_c10d_functional.irecv", "_c10d_functional.batch_p2p_ops")),
}

# Every collective that moves data between ranks (a barrier moves none and stays available).
ALL_COLLECTIVES = tuple(k for k in COLLECTIVES if k != "send_recv")


def everything_but(*kept: str) -> tuple[str, ...]:
    """Every collective and send/recv except `kept`: what an exercise about one collective switches off."""
    unknown = set(kept) - set(COLLECTIVES)
    if unknown:
        raise ValueError(f"unknown collective(s) {sorted(unknown)}: use names from {sorted(COLLECTIVES)}")
    return tuple(k for k in COLLECTIVES if k not in kept)
SENDS = ("c10d.send", "_c10d_functional.isend")
RECVS = ("c10d.recv_", "c10d.recv_any_source_", "_c10d_functional.irecv")


def op_key(func) -> str:
    """'c10d.allreduce_' for the dispatcher operator c10d::allreduce_ (any overload)."""
    return f"{func.namespace}.{func.__name__.split('.')[0]}"


OP_TO_COLLECTIVE = {op: name for name, (_, ops) in COLLECTIVES.items() for op in ops}


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
