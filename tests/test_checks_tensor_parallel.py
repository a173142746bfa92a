"""The checkers of exercises 13.1-13.3 (a linear layer split by columns and by rows; self-attention split by heads,
Shoeybi et al. 2019, figure 3): they pass correct solutions written several ways and refuse the built-in and library
shortcuts, wrong methods that give the right numbers (the whole layer on every rank, its NaNs masked away or inside
a DTensor), and wrong results, each with a message that says which. (More 13.1-13.2 cases:
test_training_tensor_parallel.py.)"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.tensor_parallel import (
    ATTENTION_ATOL,
    ATTENTION_CASES,
    ATTENTION_SHAPE,
    _Audit,
    _poisoned_attention,
    attention_flops,
    check_column_parallel_forward,
    check_row_parallel_linear,
    check_tp_attention,
)
from course_lib.training.tolerance import sum_atol


def _heads(x, attn, scale=None):
    """This rank's q, k, v as (batch, my heads, tokens, head size), and the slice of features they use."""
    rank, p = dist.get_rank(), dist.get_world_size()
    h, a = attn.embed_dim, attn.num_heads
    d, k = h // a, a // p
    mine = slice(rank * k * d, (rank + 1) * k * d)
    w, b = attn.in_proj_weight.chunk(3), attn.in_proj_bias.chunk(3)
    q, kk, v = ((x @ w[i][mine].T + b[i][mine]).unflatten(-1, (k, d)).transpose(1, 2) for i in range(3))
    return q, kk, v, mine, d


def tp_attention(x, attn):                   # the notebook's solution
    q, k, v, mine, d = _heads(x, attn)
    ctx = torch.softmax(q @ k.transpose(-2, -1) / d ** 0.5, dim=-1) @ v
    y = ctx.transpose(1, 2).flatten(2) @ attn.out_proj.weight[:, mine].T
    dist.all_reduce(y)
    return y + attn.out_proj.bias


def tp_attention_by_views(x, attn):          # written differently: a (3, heads, d, h) view and torch's SDPA
    rank, p = dist.get_rank(), dist.get_world_size()
    h, a = attn.embed_dim, attn.num_heads
    d, k = h // a, a // p
    w = attn.in_proj_weight.view(3, a, d, h)[:, rank * k:(rank + 1) * k]
    b = attn.in_proj_bias.view(3, a, d)[:, rank * k:(rank + 1) * k]
    q, kk, v = (torch.einsum("bth,kdh->bktd", x, w[i]) + b[i][None, :, None, :] for i in range(3))
    ctx = nn.functional.scaled_dot_product_attention(q, kk, v)
    wo = attn.out_proj.weight.view(h, a, d)[:, rank * k:(rank + 1) * k]
    y = torch.einsum("bktd,okd->bto", ctx, wo)
    dist.all_reduce(y)
    return y + attn.out_proj.bias


def whole_attention(x, attn):                # the built-in: every head on every rank
    return attn(x, x, x, need_weights=False)[0]


def with_the_courses_row_layer(x, attn):     # the library's RowParallelLinear for the output projection
    from course_lib.training.tensor_parallel import RowParallelLinear

    q, k, v, mine, d = _heads(x, attn)
    ctx = torch.softmax(q @ k.transpose(-2, -1) / d ** 0.5, dim=-1) @ v
    return RowParallelLinear(attn.out_proj)(ctx.transpose(1, 2).flatten(2))


def with_dtensor_scatter(x, attn):           # torch's distribute_tensor hands every rank its shard by a scatter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(x.device.type, (dist.get_world_size(),))
    distribute_tensor(attn.out_proj.weight.detach(), mesh, [Shard(1)])
    return tp_attention(x, attn)


def contexts_all_reduced_then_projected(x, attn):   # right numbers, wrong method: two all-reduces, one of h wide
    q, k, v, mine, d = _heads(x, attn)
    ctx = torch.softmax(q @ k.transpose(-2, -1) / d ** 0.5, dim=-1) @ v
    whole = torch.zeros(*x.shape[:2], attn.embed_dim, dtype=x.dtype, device=x.device)
    whole[..., mine] = ctx.transpose(1, 2).flatten(2)
    dist.all_reduce(whole)                   # every head's output on every rank (an all-gather by all-reduce)
    y = whole[..., mine] @ attn.out_proj.weight[:, mine].T
    dist.all_reduce(y)
    return y + attn.out_proj.bias


def contexts_gathered(x, attn):              # right numbers on a clean layer: all heads' outputs, whole projection
    q, k, v, mine, d = _heads(x, attn)
    ctx = (torch.softmax(q @ k.transpose(-2, -1) / d ** 0.5, dim=-1) @ v).transpose(1, 2).flatten(2).contiguous()
    parts = [torch.empty_like(ctx) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, ctx)
    return attn.out_proj(torch.cat(parts, dim=-1))


def rows_chunked_naively(x, attn):           # rank r takes rows r·3h/p.. of the stacked q, k, v weight
    rank, p = dist.get_rank(), dist.get_world_size()
    qkv = x @ attn.in_proj_weight.chunk(p)[rank].T
    return qkv.sum() + attn.out_proj.bias * 0 + x


def scaled_by_rank_width(x, attn):           # a wrong result: scores scaled by 1/sqrt(h/p), not 1/sqrt(head size)
    q, k, v, mine, d = _heads(x, attn)
    width = attn.embed_dim // dist.get_world_size()
    ctx = torch.softmax(q @ k.transpose(-2, -1) / width ** 0.5, dim=-1) @ v
    y = ctx.transpose(1, 2).flatten(2) @ attn.out_proj.weight[:, mine].T
    dist.all_reduce(y)
    return y + attn.out_proj.bias


def bias_on_every_rank(x, attn):             # a wrong result: the bias added before the sum
    q, k, v, mine, d = _heads(x, attn)
    ctx = torch.softmax(q @ k.transpose(-2, -1) / d ** 0.5, dim=-1) @ v
    y = ctx.transpose(1, 2).flatten(2) @ attn.out_proj.weight[:, mine].T + attn.out_proj.bias
    dist.all_reduce(y)
    return y


def test_correct_solutions_written_two_ways_pass(capsys):
    check_tp_attention(tp_attention)
    check_tp_attention(tp_attention_by_views)
    assert capsys.readouterr().out.count("Exercise 13.3 passed") == 2


@pytest.mark.parametrize("solution, message", [
    (whole_attention, r"read numbers outside this rank's slice"),
    (with_the_courses_row_layer, r"training\.tensor_parallel\.RowParallelLinear\.__init__ \(it holds the answer\) is "
                                 r"switched off"),
    (with_dtensor_scatter, r"scatter \(reached as torch\.ops\.c10d\.scatter_\) is switched off"),
], ids=["built-in", "library-layer", "dtensor-scatter"])
def test_shortcuts_are_refused(solution, message):
    with pytest.raises(ExerciseFailed, match=message):
        check_tp_attention(solution)


def test_wrong_methods_with_the_right_numbers_are_refused():
    with pytest.raises(ExerciseFailed, match=r"ran \[\('all_reduce', 960\), \('all_reduce', 960\)\].*exactly one "
                                             r"all_reduce"):
        check_tp_attention(contexts_all_reduced_then_projected)
    with pytest.raises(ExerciseFailed, match=r"dist\.all_gather is switched off"):
        check_tp_attention(contexts_gathered)
    with pytest.raises(ExerciseFailed, match=r"read numbers outside this rank's slice"):
        check_tp_attention(rows_chunked_naively)


def test_wrong_results_are_refused_with_what_is_wrong():
    with pytest.raises(ExerciseFailed, match=r"wrong values, off by up to"):
        check_tp_attention(scaled_by_rank_width)
    with pytest.raises(ExerciseFailed, match=r"plus 1 extra biases: the bias was added on every rank"):
        check_tp_attention(bias_on_every_rank)


def test_the_poisoned_copy_is_nan_exactly_outside_this_ranks_heads():
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(12, 6, batch_first=True, dtype=torch.float64)
    bad = _poisoned_attention(attn, rank=1, world=3)            # heads 2 and 3: features 4..7
    nan_rows = torch.isnan(bad.in_proj_weight).all(dim=1).view(3, 12)
    assert nan_rows[:, 4:8].sum() == 0 and nan_rows.sum() == 3 * 8
    assert torch.isnan(bad.out_proj.weight).all(dim=0).tolist() == [i not in range(4, 8) for i in range(12)]
    assert not torch.isnan(bad.out_proj.bias).any()


def test_the_tolerance_is_what_float64_reordering_allows_on_these_inputs():
    # the largest sum of |terms| over every sum the attention computes, on the checker's inputs
    for _, heads, h in ATTENTION_CASES:
        torch.manual_seed(0)
        attn = nn.MultiheadAttention(h, heads, batch_first=True, dtype=torch.float64)
        with torch.no_grad():
            attn.out_proj.bias += 1.0
            x = torch.randn(*ATTENTION_SHAPE, h, dtype=torch.float64)
            w, b = attn.in_proj_weight.abs(), attn.in_proj_bias.abs()
            qkv = x.abs() @ w.T + b
            d = h // heads
            q, k, v = (t.unflatten(-1, (heads, d)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
            scores = q @ k.transpose(-2, -1) / d ** 0.5
            ctx = v.amax(dim=-2, keepdim=True).expand_as(v)               # probabilities sum to 1
            out = ctx.transpose(1, 2).flatten(2) @ attn.out_proj.weight.abs().T + attn.out_proj.bias.abs()
            largest = max(t.max().item() for t in (qkv, scores, out))
        assert largest < 50
        assert 1e3 * sum_atol(terms=h, total=largest, dtype=torch.float64) < ATTENTION_ATOL


def _mine(n):
    """This rank's n / p consecutive features, as a mask."""
    rank, p = dist.get_rank(), dist.get_world_size()
    keep = torch.zeros(n, dtype=torch.bool)
    keep[rank * n // p:(rank + 1) * n // p] = True
    return keep


def column_masked(x, linear):                # right numbers, wrong method: the whole layer, other rows zeroed
    keep = _mine(linear.out_features)
    y = x @ torch.where(keep[:, None], linear.weight, 0.0).T + torch.where(keep, linear.bias, 0.0)
    return y[:, keep]


def row_masked(x, linear):                   # the same for the row split: whole-size x and weight, zeros outside
    keep = _mine(linear.in_features)
    y = torch.where(keep, x, 0.0) @ torch.where(keep, linear.weight, 0.0).T
    dist.all_reduce(y)
    return y + linear.bias


def attention_masked(x, attn):               # every head on every rank, the other ranks' weights zeroed
    t = x.transpose(0, 1)
    y = nn.functional.multi_head_attention_forward(
        t, t, t, attn.embed_dim, attn.num_heads, attn.in_proj_weight.nan_to_num(), attn.in_proj_bias.nan_to_num(),
        None, None, False, 0.0, attn.out_proj.weight.nan_to_num(), torch.zeros_like(attn.out_proj.bias),
        training=False, need_weights=False)[0].transpose(0, 1).contiguous()
    dist.all_reduce(y)
    return y + attn.out_proj.bias


def column_whole_inside_a_dtensor(x, linear):    # the whole product hidden in DTensor's dispatch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh(x.device.type, (dist.get_world_size(),))
    w = DTensor.from_local(linear.weight, mesh, [Replicate()])
    y = (DTensor.from_local(x, mesh, [Replicate()]) @ w.T).to_local()
    return y.chunk(dist.get_world_size(), dim=1)[dist.get_rank()] + linear.bias.chunk(dist.get_world_size())[
        dist.get_rank()]


def column_by_parallelize_module(x, linear):     # torch's ColwiseParallel, no collective (src_data_rank=None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh(x.device.type, (dist.get_world_size(),))
    return parallelize_module(linear, mesh, ColwiseParallel(), src_data_rank=None)(x)


def column_by_dtensor_slicing(x, linear):    # correct, written differently: Replicate -> Shard(0) slices locally
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh(x.device.type, (dist.get_world_size(),))
    w, b = (DTensor.from_local(t, mesh, [Replicate()]).redistribute(mesh, [Shard(0)]).to_local()
            for t in (linear.weight, linear.bias))
    return x @ w.T + b


def row_into_a_fresh_buffer(x, linear):      # correct: torch.empty's memory may hold old NaNs, and is overwritten
    rank, p = dist.get_rank(), dist.get_world_size()
    s = slice(rank * linear.in_features // p, (rank + 1) * linear.in_features // p)
    y = torch.empty(x.shape[0], linear.out_features, device=x.device)
    torch.matmul(x[:, s], linear.weight[:, s].T, out=y)
    dist.all_reduce(y)
    return y + linear.bias


def test_a_whole_size_product_is_refused_by_its_flops():
    for checker, masked in ((check_column_parallel_forward, column_masked), (check_row_parallel_linear, row_masked),
                            (check_tp_attention, attention_masked)):
        with pytest.raises(ExerciseFailed, match=r"your matrix products ran [\d,]+ FLOPs, [\d.]+ times this rank's "
                                                 r"share"):
            checker(masked)


def test_the_whole_layer_inside_a_dtensor_and_torchs_own_style_are_refused():
    with pytest.raises(ExerciseFailed, match=r"mm produced NaN"):
        check_column_parallel_forward(column_whole_inside_a_dtensor)
    with pytest.raises(ExerciseFailed, match=r"dist\.parallelize_module is switched off"):
        check_column_parallel_forward(column_by_parallelize_module)


def test_dtensor_slicing_and_a_fresh_buffer_pass(capsys):
    check_column_parallel_forward(column_by_dtensor_slicing)
    check_row_parallel_linear(row_into_a_fresh_buffer)
    out = capsys.readouterr().out
    assert "Exercise 13.1 passed" in out and "Exercise 13.2 passed" in out


def test_the_attention_flop_share_is_what_the_split_runs():
    # one process, every head: the FLOPs torch's formulas count for q, k, v, the scores, the context and the output
    # projection written with matrix products are attention_flops; each rank of the split runs 1/p of each
    (b, t), h, heads = ATTENTION_SHAPE, 12, 6
    x, w, wo = torch.randn(b, t, h), torch.randn(3 * h, h), torch.randn(h, h)
    with _Audit() as audit:
        q, k, v = (u.unflatten(-1, (heads, h // heads)).transpose(1, 2) for u in (x @ w.T).chunk(3, dim=-1))
        ctx = torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        ctx.transpose(1, 2).flatten(2) @ wo.T
    assert audit.flops == attention_flops(b, t, h, heads)
