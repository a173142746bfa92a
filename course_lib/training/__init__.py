"""Training algorithms across ranks, one module per concept, in the order the notebooks teach them.

- data, model, threads: the UCI digits sharded per worker, a small MLP and its single-process run (08), one intra-op
  thread for the small single-process references (11).
- worker_loop: the worker loop the trainers of 08-11b share, and the loop their single-process references share.
- ps (08); allreduce, overlap (09: by hand, in buckets, DDP; all-reduce overlapped with backward over an emulated
  NIC).
- gossip, local_sgd, compression, straggler (11, 11b: D-PSGD on graphs, local SGD and DiLoCo, top-k and PowerSGD,
  a slow rank).
- adam, zero, fsdp, sharded_loop, prefetch (12: Adam by hand, ZeRO stages 0-3, FSDP2's fully_shard, the loop they
  share, prefetching the next layer's all-gather on the emulated link).
- tensor_parallel, sequence_parallel (13: Megatron's column/row split; Korthikanti's g and g-bar, and the Linear
  fused with g that keeps only its tokens).
- pipeline, pipeline_schedules, interleaved, mixed_precision (14, 14b: stages, GPipe, 1F1B and interleaved 1F1B,
  bf16/fp16 with loss scaling).
- moe, ring_attention, mesh (15, 15b: experts over all_to_all, ring attention, 2-D device meshes).
- tolerance: how close each of them must end to its single-process reference, and why.

The cost models of the same lessons (projection, decentralized, parallel_plan) are in course_lib.costs; what
measures them (messages, collectives, timelines, memory) is in course_lib.measure.
"""

from .data import combined_batch, load_digits, worker_batch
from .model import flat_grads, flat_params, make_mlp, set_flat_params, train_single

__all__ = ["load_digits", "worker_batch", "combined_batch", "make_mlp", "flat_params", "set_flat_params",
           "flat_grads", "train_single"]
