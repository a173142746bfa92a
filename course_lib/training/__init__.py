"""Data-parallel training two ways: parameter server and all-reduce (notebooks 08-10).

data/model: the UCI digits set sharded per worker and a small MLP; ps: a parameter server over point-to-point;
allreduce: hand-written, bucketed and torch DDP all-reduce training; intercept/traffic/netem: count and delay this
rank's point-to-point messages; timeline: labelled regions from torch.profiler as per-rank lanes; projection: the
cost model's step time for PS and ring next to the emulated runs.
"""

from .data import combined_batch, load_digits, worker_batch
from .model import flat_grads, flat_params, make_mlp, set_flat_params, train_single

__all__ = ["load_digits", "worker_batch", "combined_batch", "make_mlp", "flat_params", "set_flat_params",
           "flat_grads", "train_single"]
