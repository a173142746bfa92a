"""Training across ranks: parameter server and all-reduce (notebooks 08-10), sharded and tensor parallel (13-14).

data/model: the UCI digits set sharded per worker and a small MLP; ps: a parameter server over point-to-point;
allreduce: hand-written, bucketed and torch DDP all-reduce training; intercept/traffic/netem: count and delay this
rank's point-to-point messages; timeline: labelled regions from torch.profiler as per-rank lanes; projection: the
cost model's step time for PS and ring next to the emulated runs. adam/zero/fsdp/memory: Adam by hand, ZeRO stages
0-3 from reduce-scatter and all-gather, FSDP2's fully_shard, and the bytes each rank holds; tensor_parallel: the
Megatron column/row split; comm_log: every collective a rank runs, with its bytes.
"""

from .data import combined_batch, load_digits, worker_batch
from .model import flat_grads, flat_params, make_mlp, set_flat_params, train_single

__all__ = ["load_digits", "worker_batch", "combined_batch", "make_mlp", "flat_params", "set_flat_params",
           "flat_grads", "train_single"]
