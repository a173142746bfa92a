"""Notebook 09's buckets and reducer are DDP's: buckets() assigns parameters as torch's own
compute_bucket_assignment_by_size does and as DDP rebuilds its buckets after the first backward (25 MiB, the first
1 MiB, when bucket_cap_mb is left unset); BucketReducer keeps every gradient a view into its bucket and starts one
all-reduce per bucket, in order, from inside backward; the emulated-NIC overlap takes DDP's caps and a fixed
emulated cost per layer and still trains to single-process SGD."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib import run
from course_lib.costs import alpha_beta
from course_lib.training import make_mlp
from course_lib.training.allreduce import BucketReducer, buckets
from course_lib.training.data import combined_batch, load_digits, worker_batch
from course_lib.training.model import flat_params
from course_lib.training.overlap import deep_mlp, link_for, overlap_compare
from course_lib.training.tolerance import max_diff, sgd_atol

MIB = 2**20


@pytest.mark.parametrize("model", [make_mlp(), deep_mlp()], ids=["mlp", "deep_mlp"])
@pytest.mark.parametrize("caps", [(1,), (8192,), (300_000,), (3_000_000,), (MIB, 25 * MIB), (1 << 30,)])
def test_buckets_are_torchs_own_assignment(model, caps):
    params = list(model.parameters())
    ready_order = list(range(len(params) - 1, -1, -1))          # backward: the last layer's gradients first
    want, _ = dist._compute_bucket_assignment_by_size([params[i] for i in ready_order], list(caps),
                                                      [False] * len(params), ready_order)
    got = buckets(params, caps[-1], caps[0] if len(caps) > 1 else None)
    assert [[next(i for i, q in enumerate(params) if q is p) for p in g] for g in got] == want


def test_a_bucket_holds_one_dtype():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double(), nn.Linear(4, 4))
    groups = buckets(list(model.parameters()), 1 << 30)
    assert len(groups) == 2 and all(len({p.dtype for p in g}) == 1 for g in groups)


def _ddp_rebuilt(cap_mb):
    model = deep_mlp()
    ddp = nn.parallel.DistributedDataParallel(model, **({} if cap_mb is None else {"bucket_cap_mb": cap_mb}))
    x, y = load_digits()
    for step in range(3):
        xb, yb = worker_batch(x, y, dist.get_rank(), dist.get_world_size(), 16, step)
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(xb), yb).backward()
    data = ddp._get_ddp_logging_data()
    return data["bucket_sizes"], [int(b) for b in data["rebuilt_bucket_sizes"].split(", ")]


@pytest.mark.parametrize("cap_mb", [None, 8192 / MIB, 3.0])
def test_ddp_starts_with_one_bucket_and_rebuilds_ours(cap_mb):
    first, rebuilt = run(_ddp_rebuilt, world_size=2, args=(cap_mb,), output="none", timeout=60).values[0]
    params = list(deep_mlp().parameters())
    cap = 25 * MIB if cap_mb is None else int(cap_mb * MIB)
    ours = buckets(params, cap, MIB if cap_mb is None else None)     # 1 MiB first only when the cap is the default
    assert first == str(sum(p.numel() * 4 for p in params))           # the first iteration: one bucket
    assert rebuilt == [sum(p.numel() * 4 for p in g) for g in ours]


def _reducer_step(overlap):
    model = make_mlp(32)
    launched, real = [], dist.all_reduce

    def watched(t, *args, **kwargs):
        launched.append((t.untyped_storage().data_ptr(), t.numel(), torch._C._current_graph_task_id() != -1))
        return real(t, *args, **kwargs)

    x, y = load_digits()
    xb, yb = worker_batch(x, y, dist.get_rank(), dist.get_world_size(), 16, 0)
    dist.all_reduce = watched
    try:
        reducer = BucketReducer(model, 1024, dist.all_reduce, overlap)
        reducer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        reducer.wait()
    finally:
        dist.all_reduce = real
    views = [any(p.grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in reducer.flats)
             for p in model.parameters()]
    sizes = [f.numel() for f in reducer.flats]
    return launched, views, sizes, [p.grad.clone() for p in model.parameters()]


def test_the_reducer_keeps_views_and_starts_each_bucket_in_order_inside_backward():
    for overlap in (True, False):
        launched, views, sizes, _ = run(_reducer_step, world_size=2, args=(overlap,), output="none",
                                        timeout=60).values[0]
        assert all(views) and len(sizes) == 3
        assert [n for _, n, _ in launched] == sizes
        assert all(inside == overlap for _, _, inside in launched)     # during backward, or all after it


def test_the_reducer_averages():
    def single():
        x, y = load_digits()
        model = make_mlp(32)
        xb, yb = combined_batch(x, y, 2, 16, 0)
        nn.functional.cross_entropy(model(xb), yb).backward()
        return [p.grad for p in model.parameters()]

    got = run(_reducer_step, world_size=2, args=(True,), output="none", timeout=60).values[0][3]
    for g, want in zip(got, single()):     # float32 order: the ranks' means halved and summed vs one mean of 32
        assert torch.allclose(g, want, atol=1e-6)


KW = dict(steps=2, depth=4, width=64, batch_size=16, lr=0.05)


def _single(steps, depth, width, batch_size, lr, n=2):
    x, y = load_digits()
    model = deep_mlp(depth, width)
    for step in range(steps):
        xb, yb = combined_batch(x, y, n, batch_size, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return flat_params(model)


def test_overlap_with_ddps_caps_and_a_fixed_cost_per_layer():
    res = run(overlap_compare, world_size=2, kwargs=dict(KW, layer_s=0.005, bucket_bytes=1), output="none",
              timeout=120).values
    link = res[0]["link"]
    assert link == link_for(0.005, 64, p=2)
    assert abs(alpha_beta.ring_allreduce(2, (64 * 64 + 64) * 4, link.alpha, link.beta) - 0.005) < 1e-9
    ref = _single(**KW)
    for v in res:
        for placement in ("after", "during"):
            out = v[placement]
            assert len(out["bucket_bytes"]) == 2 * KW["depth"]             # cap 1 B: every tensor its own bucket
            assert max_diff(out["params"], ref) <= sgd_atol(KW["steps"], KW["lr"], 2 * KW["batch_size"], 64)
            backward = [e for e in out["timeline"] if e[1] == "backward"]
            # each of the depth layers sleeps 5 ms in its backward hook before its arithmetic
            assert all(e - s >= KW["depth"] * 0.005 for _, _, s, e in backward)
