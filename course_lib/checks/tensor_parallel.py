"""Checkers for the exercises of notebook 13 (tensor parallelism, Megatron-LM: Shoeybi et al. 2019, section 3).

Each runs the learner's function on real ranks, every rank with a copy of the same nn.Linear (or, in 13.3,
nn.MultiheadAttention) and input in which everything outside the rank's slice (weight rows or columns, bias
entries, input columns, other ranks' attention heads) is NaN, and compares with the clean layer: computing the
whole layer and keeping a slice reads the NaNs, and any operation that produces a NaN from them is reported.
Masking the NaNs away (torch.where, nan_to_num) and multiplying the whole layer anyway is caught by the FLOPs of
the matrix products each rank runs, counted with torch's own formulas (torch/utils/flop_counter.py): a rank may
run its 1/p share of the layer's, no more. The course's parallel layers and torch's parallelize_module are
switched off while it runs, and so is every collective the split does not need (switch_off.py); the calls it
makes are counted at the dispatcher (watch.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..measure.c10d_ops import everything_but
from .core import ExerciseFailed, launch_checked, passed, watched_call, with_hint

CASES = [(2, 6, 8), (3, 6, 12)]     # (world size, in features, out features): even and odd p, each divides evenly
BATCH = 5
TP_ANSWERS = tuple(f"course_lib.training.tensor_parallel.{f}" for f in (
    "ColumnParallelLinear.forward", "RowParallelLinear.forward", "TensorParallelMLP.forward", "copy_to_tp",
    "reduce_from_tp", "gather_from_tp", "ColumnParallelLinear.__init__", "RowParallelLinear.__init__", "_slice",
    "_ReduceFromTP.forward", "_ReduceFromTP.backward")) + tuple(
    f"course_lib.training.sequence_parallel.{f}" for f in ("gather_linear", "gather_matmul", "gather_tokens",
                                                            "scatter_tokens")) + (
    "torch.distributed.tensor.parallel.api.parallelize_module",     # torch's ColwiseParallel / RowwiseParallel,
    "torch.distributed.tensor.parallel.style.ColwiseParallel._apply",   # also reached without parallelize_module
    "torch.distributed.tensor.parallel.style.RowwiseParallel._apply",
    "torch.distributed.tensor._api.distribute_module")
EVERY_OTHER = everything_but("all_reduce")


# Operators that make a tensor without reading any: torch.empty's memory may hold NaN from freed poisoned tensors
_FRESH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class _Audit(TorchDispatchMode):
    """Notes the first operation (views and fresh allocations aside) that returns a NaN, on a poisoned layer a read
    outside the slice, and adds up the FLOPs of every matrix product (torch's flop_counter formulas). A DTensor
    operation is handed back (NotImplemented), as torch's CommDebugMode does, so that its local operations on
    plain tensors come through here and are checked too."""

    def __init__(self):
        super().__init__()
        self.ops, self.flops = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor
        from torch.utils.flop_counter import flop_registry
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):     # no overload packet, not a product: run it
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        outs = [t for t in (out if isinstance(out, list | tuple) else [out]) if isinstance(t, torch.Tensor)]
        if any(t.is_meta or isinstance(t, FakeTensor) for t in outs):    # DTensor working out shapes: no numbers
            return out
        if func.overloadpacket in flop_registry:
            self.flops += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        if not func.is_view and not self.ops and func.overloadpacket.__name__ not in _FRESH:
            if any(t.is_floating_point() and bool(torch.isnan(t).any()) for t in outs):
                self.ops.append(str(func.overloadpacket.__name__))
        return out


def _poisoned(linear, x, rank, world, split):
    """A copy of `linear` and `x` with NaN wherever this rank's slice ends: split "column" poisons the weight rows
    and bias entries of other ranks' output features; "row" the weight columns and input columns of theirs."""
    bad = nn.Linear(linear.in_features, linear.out_features).to(x.device)
    bad.load_state_dict(linear.state_dict())
    x = x.clone()
    n = linear.out_features if split == "column" else linear.in_features
    k = n // world
    outside = torch.ones(n, dtype=torch.bool, device=x.device)
    outside[rank * k:(rank + 1) * k] = False
    with torch.no_grad():
        if split == "column":
            bad.weight[outside] = float("nan")
            bad.bias[outside] = float("nan")
        else:
            bad.weight[:, outside] = float("nan")
            x[:, outside] = float("nan")
    return bad, x


def _case(exercise, learner, n_in, n_out, forbid, why, split):
    """On every rank: the same clean layer and input (same seed) give nn.Linear's answer; the learner gets a copy
    poisoned outside this rank's slice; returns both, the calls made and the first op that produced a NaN."""
    from ..runtime.devices import device
    torch.manual_seed(0)
    linear = nn.Linear(n_in, n_out).to(device())
    with torch.no_grad():
        linear.bias += 1.0                       # a bias far from zero: adding it on every rank shows
        x = torch.randn(BATCH, n_in, device=device())
        want = linear(x)
        bad, bad_x = _poisoned(linear, x, dist.get_rank(), dist.get_world_size(), split)
        with _Audit() as seen:
            got, record = watched_call(exercise, learner, (bad_x, bad), forbid=forbid, why=why, library=TP_ANSWERS)
    got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
    return {"want": want.cpu(), "got": got, "calls": [(name, size) for name, size, *_ in record["collectives"]],
            "rank": dist.get_rank(), "bias": linear.bias.detach().cpu(), "nan_from": seen.ops, "flops": seen.flops,
            "share": 2 * BATCH * n_in * n_out // dist.get_world_size()}     # addmm: 2 FLOPs per multiply-add


def _compare(exercise, world, vals, expect, hint, diagnose=None, atol=1e-5):
    """Every rank's answer against expect(nn.Linear's output, rank, world); yields each rank's calls."""
    for v in vals:
        case, want, got = f"{world} ranks, rank {v['rank']}", expect(v["want"], v["rank"], world), v["got"]
        if not isinstance(got, torch.Tensor):
            raise ExerciseFailed(with_hint(f"{exercise}: {case}: you returned {type(got).__name__}, not a tensor.",
                                           hint))
        if got.shape != want.shape:
            raise ExerciseFailed(with_hint(f"{exercise}: {case}: your output has shape {tuple(got.shape)}, expected "
                                           f"{tuple(want.shape)}.", hint))
        if v["nan_from"]:
            raise ExerciseFailed(with_hint(
                f"{exercise}: {case}: your code read numbers outside this rank's slice: the checker set them to NaN, "
                f"and {v['nan_from'][0]} produced NaN from them. A tensor-parallel rank holds only its slice.", hint))
        # 13.1-13.2: float32 products of 6 terms, summed in another order or split over ranks: 1e-5 is 100x that
        # rounding; 13.3 passes its own (ATTENTION_ATOL)
        if not torch.allclose(got.double(), want.double(), atol=atol):
            extra = (diagnose(v, world) or "") if diagnose else ""
            raise ExerciseFailed(with_hint(f"{exercise}: {case}: wrong values, off by up to "
                                           f"{(got - want).abs().max().item():.3g}.{extra}", hint))
        if v["flops"] > v["share"]:
            raise ExerciseFailed(with_hint(
                f"{exercise}: {case}: your matrix products ran {v['flops']:,} FLOPs, {v['flops'] / v['share']:.3g} "
                f"times this rank's share of the layer ({v['share']:,}, the whole layer's / {world}): right numbers, "
                f"but from a whole-size product (zeros in place of the other ranks' numbers?). A tensor-parallel "
                f"rank multiplies only its slice.", hint))
        yield v["calls"]


def check_column_parallel_forward(column_parallel_forward, exercise: str = "Exercise 13.1") -> None:
    """`column_parallel_forward(x, linear)` -> this rank's slice of linear(x) (its out_features / p output columns),
    computed from its slice of the weight with no communication (every collective is off); 2 and 3 real ranks.
    The weight rows and bias entries of the other ranks' columns are NaN."""
    hint = ("Splitting a linear layer by output features: which rows of the weight and which bias entries does rank r "
            "own, and does it need anything from another rank?")
    for world, n_in, n_out in CASES:
        args = (exercise, column_parallel_forward, n_in, n_out, ("all", "send_recv"), "a split that needs no "
                "communication", "column")
        vals = launch_checked(exercise, _case, world, args=args, hint=hint, what=f"{world} ranks")
        for _ in _compare(exercise, world, vals, lambda y, r, p: y.chunk(p, dim=1)[r], hint):
            pass
    return passed(exercise, "every rank's output columns equal nn.Linear's on 2 and 3 ranks, from its slice alone "
                            "(1/p of the FLOPs), with every collective switched off")


def _bias_counted(v, world):
    if v["got"].shape == v["want"].shape and torch.allclose(v["got"], v["want"] + (world - 1) * v["bias"], atol=1e-4):
        return (f" Your result is the layer's plus {world - 1} extra biases: the bias was added on every rank before "
                f"the all-reduce, so the sum holds it {world} times.")
    return None


def check_row_parallel_linear(row_parallel_linear, exercise: str = "Exercise 13.2") -> None:
    """`row_parallel_linear(x, linear)` -> linear(x) on every rank, from this rank's in_features / p input columns
    and weight columns, ONE all_reduce of the batch x out partial sums, the bias added once; 2 and 3 ranks. The
    other ranks' input columns of x and of the weight are NaN."""
    hint = ("Splitting by input features makes each rank's product a partial sum. What combines the partial sums, and "
            "how many times should the bias be added?")
    for world, n_in, n_out in CASES:
        vals = launch_checked(exercise, _case, world, args=(exercise, row_parallel_linear, n_in, n_out, EVERY_OTHER,
                                                            "one all-reduce of partial sums", "row"),
                              hint=hint, what=f"{world} ranks")
        for calls in _compare(exercise, world, vals, lambda y, r, p: y, hint, _bias_counted):
            want = [("all_reduce", BATCH * n_out * 4)]
            if calls != want:
                raise ExerciseFailed(with_hint(f"{exercise}: {world} ranks: your function ran {calls} (op, bytes); "
                                               f"expected exactly one all_reduce of the {BATCH} x {n_out} float32 "
                                               f"partial sums, {want[0][1]} bytes.", hint))
    return passed(exercise, "linear(x) on every rank for 2 and 3 ranks, from its slice alone (1/p of the FLOPs), with "
                            "exactly one all_reduce")


# (world size, heads, embedding h): 3 and 2 heads per rank of size 2, so the head size (2), a rank's width h/p (6, 4)
# and h (12) are three different numbers; batch 2 of 5 tokens
ATTENTION_CASES = [(2, 6, 12), (3, 6, 12)]
ATTENTION_SHAPE = (2, 5)
# float64: every sum here has at most h = 12 terms whose sizes add up to less than 50 on these inputs
# (tests/test_checks_tensor_parallel.py checks it), so one reordering moves it by at most 2·12·2^-53·50 ≈ 1.3e-13;
# 1e-9 leaves room for the few sums each result passes through, and every wrong method misses by more than 1e-3
ATTENTION_ATOL = 1e-9


def attention_flops(batch: int, tokens: int, h: int, heads: int) -> int:
    """FLOPs of the matrix products of nn.MultiheadAttention on batch x tokens x h (2 per multiply-add): the q, k, v
    projections 3·h², the scores and the context tokens·h each, the output projection h², per token."""
    return 2 * batch * tokens * (3 * h * h + 2 * tokens * h + h * h)


def _poisoned_attention(attn, rank, world):
    """A copy of `attn` with NaN in every weight of the other ranks' heads: their query, key and value rows of
    in_proj (the three stacked h x h blocks) and in_proj_bias, and their columns of out_proj.weight."""
    h = attn.embed_dim
    bad = nn.MultiheadAttention(h, attn.num_heads, batch_first=True, dtype=attn.in_proj_weight.dtype,
                                device=attn.in_proj_weight.device)
    bad.load_state_dict(attn.state_dict())
    k = h // world                                      # this rank's heads are the features r·h/p .. (r+1)·h/p
    outside = torch.ones(h, dtype=torch.bool, device=attn.in_proj_weight.device)
    outside[rank * k:(rank + 1) * k] = False
    with torch.no_grad():
        bad.in_proj_weight.view(3, h, h)[:, outside] = float("nan")
        bad.in_proj_bias.view(3, h)[:, outside] = float("nan")
        bad.out_proj.weight[:, outside] = float("nan")
    return bad.eval()


def _attention_case(exercise, learner, heads, h):
    """On every rank: the same clean attention and x give nn.MultiheadAttention's output; the learner gets a copy
    poisoned outside this rank's heads."""
    from ..runtime.devices import device
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(h, heads, batch_first=True, dtype=torch.float64, device=device()).eval()
    with torch.no_grad():
        attn.out_proj.bias += 1.0                       # a bias far from zero: adding it on every rank shows
        x = torch.randn(*ATTENTION_SHAPE, h, dtype=torch.float64, device=device())
        want = attn(x, x, x, need_weights=False)[0]
        bad = _poisoned_attention(attn, dist.get_rank(), dist.get_world_size())
        with _Audit() as seen:
            got, record = watched_call(exercise, learner, (x.clone(), bad), forbid=EVERY_OTHER,
                                       why="one all-reduce after the heads' output projection", library=TP_ANSWERS)
    got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
    return {"want": want.cpu(), "got": got, "calls": [(name, size) for name, size, *_ in record["collectives"]],
            "rank": dist.get_rank(), "bias": attn.out_proj.bias.detach().cpu(), "nan_from": seen.ops,
            "flops": seen.flops, "share": attention_flops(*ATTENTION_SHAPE, h, heads) // dist.get_world_size()}


def check_tp_attention(tp_attention, exercise: str = "Exercise 13.3") -> None:
    """`tp_attention(x, attn)` -> attn(x, x, x)[0] on every rank for an nn.MultiheadAttention (batch_first), from this
    rank's num_heads / p consecutive heads only (their q, k, v rows of in_proj, their columns of out_proj) and ONE
    all_reduce of the batch x tokens x h partial sums; 2 and 3 ranks, float64 (Shoeybi et al. 2019, figure 3b)."""
    hint = ("Each rank owns whole heads. Which rows of each of the three stacked blocks of in_proj_weight belong to "
            "its heads, what scales each head's scores, and which columns of out_proj multiply its heads' outputs?")
    for world, heads, h in ATTENTION_CASES:
        vals = launch_checked(exercise, _attention_case, world, args=(exercise, tp_attention, heads, h),
                              hint=hint, what=f"{world} ranks")
        for calls in _compare(exercise, world, vals, lambda y, r, p: y, hint, _bias_counted, atol=ATTENTION_ATOL):
            want = [("all_reduce", ATTENTION_SHAPE[0] * ATTENTION_SHAPE[1] * h * 8)]
            if calls != want:
                raise ExerciseFailed(with_hint(
                    f"{exercise}: {world} ranks: your function ran {calls} (op, bytes); expected exactly one "
                    f"all_reduce of the {ATTENTION_SHAPE[0]} x {ATTENTION_SHAPE[1]} x {h} float64 partial sums of "
                    f"the output projection, {want[0][1]} bytes.", hint))
    return passed(exercise, "attn(x, x, x) on every rank for 2 and 3 ranks, from this rank's heads only (1/p of the "
                            "FLOPs), with exactly one all_reduce")
