"""Training algorithms across ranks: parameter server, all-reduce data parallel (notebooks 08-10), ZeRO, FSDP2 and
tensor parallel (12-13).

data/model: the UCI digits set sharded per worker and a small MLP; ps: a parameter server over point-to-point;
allreduce: hand-written, bucketed and torch DDP all-reduce training; projection/scaling: the cost model's step time
for PS and ring next to emulated runs; adam/zero/fsdp/sharded_loop: Adam by hand, ZeRO stages 0-3 from
reduce-scatter and all-gather, FSDP2's fully_shard, and the loop they share; tensor_parallel: the Megatron
column/row split; tolerance: how close each of them must end to its single-process reference. What measures them
(messages, collectives, timelines, memory) is in course_lib.measure.
"""

from .data import combined_batch, load_digits, worker_batch
from .model import flat_grads, flat_params, make_mlp, set_flat_params, train_single

__all__ = ["load_digits", "worker_batch", "combined_batch", "make_mlp", "flat_params", "set_flat_params",
           "flat_grads", "train_single"]
