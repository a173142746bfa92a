"""torch's fully sharded data parallel (FSDP2, `fully_shard`) on the course MLP, with torch.optim.Adam (notebook 12).

Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel" (VLDB), and FSDP2's
torch.distributed.fsdp.fully_shard: every parameter becomes a DTensor sharded by rows (Shard(0)) over a 1-D
device mesh; each fully_shard'ed module's parameters are all-gathered together before its forward and again
before its backward, and its gradients reduce-scattered (and averaged) after. The optimizer is torch's, unchanged:
built on the DTensor parameters, it keeps its state as DTensors of the same shards, so each rank steps its own rows.
Compared with zero.py's stage 3 (same Adam: Kingma & Ba's rule, betas (0.9, 0.999), eps 1e-8, as adam.adam_step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from .adam import BETAS, EPS
from .model import make_mlp
from .sharded_loop import train_steps


def fsdp_train(steps: int = 5, batch_size: int = 32, lr: float = 1e-3, hidden: int = 256, seed: int = 0,
               comm_log: bool = True, dtype: torch.dtype = torch.float32) -> dict:
    """Run on every rank: fully_shard each Linear, then the root; torch.optim.Adam on the DTensor parameters.
    Returns the same keys as zero.zero_train (final full parameters, losses, memory at the end of the last
    backward, CommLog summary per step); dtype as zero_train's. The optimizer bytes are Adam's m and v (its 4-byte
    step counters, one per tensor, left out, as in the ZeRO paper's count)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    p = dist.get_world_size()
    dev = device()
    model = make_mlp(hidden, seed, dtype).to(dev)
    shapes = [tuple(q.shape) for q in model.parameters()]
    mesh = init_device_mesh(dev.type, (p,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)        # one unit per layer: gathered together, resharded after use
    fully_shard(model, mesh=mesh)                # the root: owns no parameters itself here, drives the schedule
    params = list(model.parameters())            # DTensors; q.to_local() is this rank's rows
    opt = torch.optim.Adam(params, lr=lr, betas=BETAS, eps=EPS)

    def update(t):
        opt.step()                               # each rank updates its own rows, with its own rows of m and v

    def adam_state():
        return [opt.state[q][k] for q in params if q in opt.state for k in ("exp_avg", "exp_avg_sq")]

    # backward gathers again, then reduce-scatters (averaged) into the q.grad shards
    losses, traffic, memory = train_steps(model, params, steps, batch_size, seed, comm_log, update,
                                          grads=lambda: [q.grad for q in params], optimizer_state=adam_state)
    full = torch.cat([q.full_tensor().reshape(-1) for q in params]).detach().cpu()
    return {"params": full, "losses": losses, "memory": memory, "gathered_peak": None, "traffic": traffic,
            "shapes": shapes}
