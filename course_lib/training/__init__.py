"""Training algorithms across ranks, one module per concept, in the order the notebooks teach them.

- data, model: the UCI digits sharded per worker and a small MLP; threads: one intra-op thread for small references.
- ps (08); allreduce, overlap (09: by hand, in buckets, DDP; all-reduce overlapped with backward over an emulated
  NIC); projection, scaling (10: the cost model's step time for PS and ring next to emulated runs).
- gossip, local_sgd, compression, decentralized_cost, straggler (11: D-PSGD on graphs, local SGD and DiLoCo,
  top-k and PowerSGD, their costs side by side, a slow rank).
- adam, zero, fsdp, sharded_loop, prefetch (12: Adam by hand, ZeRO stages 0-3, FSDP2's fully_shard, the loop they
  share, prefetching the next layer's all-gather on the emulated link).
- tensor_parallel, sequence_parallel (13: Megatron's column/row split; Korthikanti's g and g-bar, and the Linear
  fused with g that keeps only its tokens).
- pipeline, pipeline_schedules, mixed_precision, parallel_plan (14: stages, GPipe and 1F1B, bf16/fp16 with loss
  scaling, a DP/ZeRO/TP/PP layout calculator).
- moe, ring_attention, mesh (15: experts over all_to_all, ring attention, 2-D device meshes).
- tolerance: how close each of them must end to its single-process reference, and why.

What measures them (messages, collectives, timelines, memory) is in course_lib.measure.
"""

from .data import combined_batch, load_digits, worker_batch
from .model import flat_grads, flat_params, make_mlp, set_flat_params, train_single

__all__ = ["load_digits", "worker_batch", "combined_batch", "make_mlp", "flat_params", "set_flat_params",
           "flat_grads", "train_single"]
