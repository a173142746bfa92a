"""Tensor parallelism (张量并行): one linear layer, one MLP, split over ranks (notebooks/13_tensor_parallel.ipynb).

Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053), section 3 and figure 3. With Y = X A (A = weight.T of an
nn.Linear, in x out): a column-parallel layer gives rank r the columns of A (output features) r*k..(r+1)*k, so it
computes its own slice of Y with no communication; a row-parallel layer gives rank r the rows of A (input
features) of the same range, so it computes a partial sum of Y that an all-reduce completes. Column then row makes
an MLP with one all-reduce in forward (g) and, when the input needs a gradient, one in backward (f). Splits must be
even, as in Megatron (`ensure_divisibility`): a size the world does not divide is a ValueError.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from .. import device
from .data import combined_batch, load_digits
from .model import make_mlp


def check_divisible(features: int, p: int, what: str = "hidden size") -> int:
    """features / p, or a ValueError saying which sizes would work (Megatron requires an even split)."""
    if p < 1 or features % p:
        ok = [d for d in range(1, features + 1) if features % d == 0 and d <= 16]
        raise ValueError(f"tensor parallelism splits the {what} {features} evenly over {p} ranks, and {p} does not "
                         f"divide {features}; use a world size in {ok} or a {what} that is a multiple of {p}.")
    return features // p


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward (Shoeybi et al. 2019, fig. 3)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if dist.get_world_size(ctx.group) == 1:      # one rank: nothing to add (Megatron bypasses it too)
            return grad, None
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)      # each rank holds one partial dL/dX; the sum is the real one
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward (the conjugate of f; Shoeybi et al. 2019, fig. 3, Code 1)."""

    @staticmethod
    def forward(ctx, x, group):
        if dist.get_world_size(group) == 1:
            return x.view_as(x)
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)             # the partial sums of the row-parallel layer become Y
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None                           # every rank already holds the whole dL/dY


class _GatherFromTP(torch.autograd.Function):
    """All-gather of column slices forward, keep one's own slice backward (Megatron's gather_from_...region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if dist.get_world_size(group) == 1:
            return x.view_as(x)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        r, p = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(p, dim=-1)[r].contiguous(), None


def copy_to_tp(x, group=None):
    """f: identity forward, all-reduce backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group=None):
    """g: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x, group=None):
    """Concatenate every rank's column slice along the last dimension (backward: this rank's slice of the grad)."""
    return _GatherFromTP.apply(x, group)


def _slice(n: int, group) -> slice:
    p, r = dist.get_world_size(group), dist.get_rank(group)
    k = check_divisible(n, p, "number of features")
    return slice(r * k, (r + 1) * k)


class ColumnParallelLinear(nn.Module):
    """This rank's output features of `linear` (rows of weight = columns of A); its output is a column slice of Y
    unless gather_output (Megatron ColumnParallelLinear, Shoeybi et al. 2019, section 3)."""

    def __init__(self, linear: nn.Linear, group=None, gather_output: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        s = _slice(linear.out_features, group)
        self.weight = nn.Parameter(linear.weight.detach()[s].clone())           # (out/p, in)
        self.bias = nn.Parameter(linear.bias.detach()[s].clone()) if linear.bias is not None else None

    def forward(self, x):
        y = nn.functional.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """This rank's input features of `linear` (columns of weight = rows of A): partial sums, all-reduced by g, and
    the bias added once after the sum (Megatron RowParallelLinear, Shoeybi et al. 2019, section 3)."""

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        self.group = group
        s = _slice(linear.in_features, group)
        self.weight = nn.Parameter(linear.weight.detach()[:, s].clone())        # (out, in/p)
        # the bias is whole on every rank (where it is added is exercise 13.2's question)
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, x_slice):
        y = reduce_from_tp(nn.functional.linear(x_slice, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class TensorParallelMLP(nn.Module):
    """Column-parallel Linear, ReLU, row-parallel Linear: no communication between the two (the ReLU acts on
    whole columns), one all-reduce forward, one backward if the input needs a gradient (Megatron figure 3a)."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, group=None):
        super().__init__()
        self.fc1, self.fc2 = ColumnParallelLinear(fc1, group), RowParallelLinear(fc2, group)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def tp_digits_mlp(hidden: int = 256, seed: int = 0, group=None) -> nn.Sequential:
    """notebook 08's digits MLP (64->h->h->10) with its first two Linears split (column, row), the head replicated."""
    full = make_mlp(hidden, seed)
    return nn.Sequential(TensorParallelMLP(full[0], full[2], group), nn.ReLU(), full[4])


def gather_full_params(model: nn.Sequential, group=None) -> torch.Tensor:
    """The full weights of a tp_digits_mlp, gathered from every rank, flat in make_mlp's parameter order."""
    def gather(t, dim):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.detach().contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    mlp, head = model[0], model[2]
    full = [gather(mlp.fc1.weight, 0), gather(mlp.fc1.bias, 0), gather(mlp.fc2.weight, 1), mlp.fc2.bias.detach(),
            head.weight.detach(), head.bias.detach()]
    return torch.cat([t.reshape(-1) for t in full]).cpu()


def param_bytes(model: nn.Module) -> int:
    """Bytes of the parameter tensors this rank really holds."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def tp_param_bytes_formula(hidden: int, p: int, n_in: int = 64, n_out: int = 10, bytes_per: int = 4) -> int:
    """Per-rank parameter bytes of tp_digits_mlp: split weights and fc1's bias /p; fc2's bias and the head whole."""
    split = (n_in + 1 + hidden) * check_divisible(hidden, p)       # fc1 weight + bias, fc2 weight, each /p
    whole = hidden + hidden * n_out + n_out
    return (split + whole) * bytes_per


def _dtensor_mlp(hidden: int, seed: int, dev) -> nn.Sequential:
    """The same split with torch's DTensor API: Linear "0" column-wise, Linear "2" row-wise, the head replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    return parallelize_module(make_mlp(hidden, seed).to(dev), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def tp_train(steps: int = 5, batch: int = 32, lr: float = 0.1, hidden: int = 256, seed: int = 0,
             impl: str = "ours") -> dict:
    """Run on every rank: SGD on the split digits MLP (impl "ours": tp_digits_mlp; "dtensor": torch's API), every
    rank on the SAME full batch (TP splits the model, not the data). Returns the gathered full weights, the losses
    and this rank's parameter bytes."""
    check_divisible(hidden, dist.get_world_size())
    dev = device()
    x, y = load_digits()
    if impl not in ("ours", "dtensor"):
        raise ValueError(f"impl must be 'ours' or 'dtensor', got {impl!r}")
    model = tp_digits_mlp(hidden, seed).to(dev) if impl == "ours" else _dtensor_mlp(hidden, seed, dev)
    losses = []
    for step in range(steps):
        xb, yb = combined_batch(x, y, 1, batch, step, seed)        # the same batch on every rank
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(xb.to(dev)), yb.to(dev))
        loss.backward()
        with torch.no_grad():
            for prm in model.parameters():                          # each rank updates only what it holds
                prm -= lr * prm.grad
        losses.append(loss.item())
    if impl == "dtensor":
        def whole(t):                                               # the head stays a plain tensor
            return t.full_tensor() if hasattr(t, "full_tensor") else t
        local = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
                    for t in model.parameters())
        full = torch.cat([whole(t.detach()).reshape(-1) for t in model.parameters()]).cpu()
        return {"params": full, "losses": losses, "param_bytes": local}
    return {"params": gather_full_params(model), "losses": losses, "param_bytes": param_bytes(model)}


def launch_tp_train(world_size: int, timeout: float = 60, **kwargs) -> list[dict]:
    """run(tp_train) on world_size ranks after checking the split in the kernel (ValueError before any process)."""
    from ..runtime.launch import run
    check_divisible(kwargs.get("hidden", 256), world_size)
    return run(tp_train, world_size=world_size, kwargs=kwargs, output="none", timeout=timeout).values


def mlp_comm_formula(batch: int, h_in: int, h_out: int, p: int, input_grad: bool, bytes_per: int = 4) -> list:
    """The collectives of one TensorParallelMLP forward + backward as (op, S bytes, p): g's all-reduce of the
    batch x h_out output, and f's of the batch x h_in input gradient if the input needs one (Megatron, sec. 3)."""
    calls = [("all_reduce", batch * h_out * bytes_per, p)]
    return calls + ([("all_reduce", batch * h_in * bytes_per, p)] if input_grad else [])


def megatron_layer_cost(hidden: int, seq: int, micro_batch: int, tp: int, link: dict, accel: dict,
                        bytes_per: int = 2, mfu: float = 1.0) -> dict:
    """Seconds per transformer layer (forward + backward) at tensor-parallel degree tp: compute vs the 4 ring
    all-reduces of an s x b x h activation (2 forward, 2 backward; Shoeybi et al. 2019, figure 4). Layer FLOPs
    forward 24 b s h^2 (1 + s / 6h), backward twice that (Narayanan et al. SC'21, appendix); MLP 16 b s h^2."""
    from ..costs.alpha_beta import ring_allreduce
    b, s, h = micro_batch, seq, hidden
    n = b * s * h * bytes_per
    one = ring_allreduce(tp, n, link["typical_latency_us"] * 1e-6, 1 / (link["GBps_one_direction"] * 1e9))
    rate = tp * accel["fp16_dense_TFLOPS"] * 1e12 * mfu
    layer_s = 3 * 24 * b * s * h * h * (1 + s / (6 * h)) / rate
    mlp_s = 3 * 16 * b * s * h * h / rate
    return {"activation_bytes": n, "allreduce_s": one, "mlp_comm_s": 2 * one, "layer_comm_s": 4 * one,
            "mlp_compute_s": mlp_s, "layer_compute_s": layer_s, "comm_over_compute": 4 * one / layer_s}


def rank_layout(dp: int, tp: int, pp: int, gpus_per_node: int = 8) -> list[dict]:
    """Each global rank's (node, pipeline stage, data replica, tensor rank) in Megatron-DeepSpeed's order: axes
    pipe, data, model, the tensor (model) axis fastest (DeepSpeed PipeModelDataParallelTopology)."""
    return [{"rank": r, "node": r // gpus_per_node, "gpu": r % gpus_per_node, "stage": r // (dp * tp),
             "replica": r // tp % dp, "tp_rank": r % tp} for r in range(dp * tp * pp)]


def parallel_degrees(text: str) -> dict:
    """{"data": 8, "tensor": 4, "pipeline": 12} from a `parallelism` cell of data/training_runs.csv ("data 8 x
    tensor 4 x pipeline 12"); an axis the text does not give is left out, never guessed."""
    return {name: int(n) for name, n in re.findall(r"\b(data|tensor|pipeline) (\d+)", text)}
