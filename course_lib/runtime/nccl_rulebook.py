"""The NCCL rulebook: what NCCL refuses or hangs on, each with its source and the fix; nccl_rules.py enforces it.

notebooks/04_point_to_point.ipynb teaches the rules; each was checked in torch 2.13's sources (distributed_c10d.py,
ProcessGroupNCCL.cpp) or NCCL's documentation.
"""

from __future__ import annotations

# rule -> (what NCCL does, its source, the fix)
RULES = {
    "p2p-order": ("a rank's unbatched sends, receives and collectives on one group run in the order it issued them, "
                  "and ncclSend/ncclRecv block the GPU until their peer's matching call",
                  "NCCL API docs, ncclSend/ncclRecv: 'If multiple ncclSend() and ncclRecv() operations need to "
                  "progress concurrently to complete, they must be fused within a ncclGroupStart()/ncclGroupEnd()'; "
                  "ProcessGroupNCCL::pointToPoint with device_id: 'unbatched P2P ops ... are serialized with all "
                  "other ops on this ProcessGroup'",
                  "post the step's sends and receives together with dist.batch_isend_irecv([...]), or order them "
                  "so that no rank waits on a peer that waits on it (even ranks send first)"),
    "first-batch": ("if batch_isend_irecv is the first call on a group, every rank of the group must make it",
                    "torch 2.13 docstring of torch.distributed.batch_isend_irecv",
                    "make the first call on the group one that every rank makes (a barrier, or the batch on all)"),
    "reduce-op": ("ProcessGroupNCCL has no bitwise reductions: BAND, BOR and BXOR are refused",
                  "ProcessGroupNCCL.cpp, getNcclReduceOp: 'Cannot use ReduceOp.BAND with NCCL' (gloo allows them "
                  "on integers)",
                  "use MAX/MIN on 0/1 tensors for and/or, or SUM and a parity for xor"),
    "any-source": ("ProcessGroupNCCL cannot receive from any source",
                   "ProcessGroupNCCL::recvAnysource: 'ProcessGroupNCCL does not support recvAnysource'",
                   "name the sender: dist.recv(t, src=...)"),
    "host-tensor": ("a group made for NCCL moves only tensors on the GPU; a CPU tensor is refused",
                    "c10d ProcessGroup::getBackend: 'No backend type associated with device type cpu'; "
                    "ProcessGroupNCCL's check_gpu_single_tensor: 'Tensors must be CUDA and dense'",
                    "create it on the rank's device: torch.ones(4, device=device()) (course_lib.device), "
                    "or move it with .to(device())"),
    "dtype": ("ProcessGroupNCCL maps only some dtypes to NCCL types (no int16, no unsigned types wider than 8 bits)",
              "NCCLUtils.hpp, the ncclDataType table: 'Input tensor data type is not supported for NCCL process "
              "group'",
              "send a supported dtype (float32, float16, bfloat16, float64, int8, uint8, int32, int64, bool)"),
    "monitored-barrier": ("monitored_barrier exists only on gloo",
                          "torch 2.13 docstring of monitored_barrier: 'only supported with the GLOO backend'",
                          "use dist.barrier(), or a gloo group made for it: dist.new_group(backend='gloo')"),
    "tags": ("NCCL ignores send/recv tags and matches a pair's messages in the order they were issued",
             "ProcessGroupNCCL::send and ::recv take the tag as an unused argument",
             "receive a peer's messages in the order it sent them, or tell them apart by content"),
}

BAD_OPS = ("BAND", "BOR", "BXOR")
# dtypes NCCLUtils.hpp's ncclDataType table maps (torch 2.13); anything else raises there
NCCL_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool",
               "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz")


class NcclRuleBroken(RuntimeError):
    """A call that NCCL would refuse or that would hang there; the message names the rule, its source and the fix."""


def broken(rule: str, rank: int, detail: str) -> NcclRuleBroken:
    """The error a rank raises: the rule, what NCCL does, its source and the fix, in one sentence a learner acts on."""
    what, source, fix = RULES[rule]
    return NcclRuleBroken(f"NCCL rule '{rule}' on rank {rank}: {detail}. On NCCL, {what} ({source}). Fix: {fix}.")
