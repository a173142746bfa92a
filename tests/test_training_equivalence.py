"""Synchronous data parallel = single-process SGD on the combined batch, to the float32 rounding bound
(training/tolerance.py): PS (1 and 2 servers), per-gradient all-reduce, buckets (with and without overlap, with
accumulation), torch DDP (with no_sync accumulation)."""

import pytest
import torch

from course_lib import run
from course_lib.training import train_single
from course_lib.training.allreduce import buckets, dp_train
from course_lib.training.data import load_digits, shard_indices
from course_lib.training.ps import ps_train
from course_lib.training.tolerance import max_diff, sgd_atol

STEPS, BATCH = 4, 16


def tol(n_workers: int) -> float:
    """What float32 summation order can change after STEPS SGD steps of lr 0.1 on n_workers x BATCH samples."""
    return sgd_atol(STEPS, 0.1, n_workers * BATCH, 256)


@pytest.fixture(scope="module")
def reference():
    return {n: train_single(n, STEPS, BATCH)[0] for n in (2, 3)}


def test_digits_load_and_shards_are_disjoint():
    x, y = load_digits()
    assert x.shape == (1797, 64) and y.shape == (1797,) and 0 <= x.min() and x.max() <= 1
    assert sorted(y.unique().tolist()) == list(range(10))
    shards = [set(shard_indices(1797, w, 4).tolist()) for w in range(4)]
    assert all(len(s) == 449 for s in shards) and len(set.union(*shards)) == 4 * 449


@pytest.mark.parametrize("k", [1, 2])
def test_sync_ps_equals_single_process(reference, k):
    res = run(ps_train, world_size=k + 3, kwargs=dict(steps=STEPS, batch_size=BATCH, n_servers=k),
              output="none", timeout=60)
    ref = reference[3]
    for r in range(k, k + 3):
        assert max_diff(res.values[r]["params"], ref) <= tol(3), f"worker rank {r}"
    assert max_diff(torch.cat([res.values[s]["params"] for s in range(k)]), ref) <= tol(3)


@pytest.mark.parametrize("kw", [dict(method="naive"), dict(method="naive", accum=2),
                                dict(method="bucket", bucket_bytes=50_000),
                                dict(method="bucket", bucket_bytes=50_000, overlap=True, accum=2),
                                dict(method="bucket", collective="ring", bucket_bytes=1 << 30),
                                dict(method="ddp", bucket_bytes=50_000), dict(method="ddp", accum=4)],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_all_reduce_equals_single_process(reference, kw):
    res = run(dp_train, world_size=2, kwargs=dict(steps=STEPS, batch_size=BATCH, **kw), output="none", timeout=60)
    for r, v in enumerate(res.values):
        assert max_diff(v["params"], reference[2]) <= tol(2), f"rank {r}"


def test_async_ps_records_staleness_and_learns():
    res = run(ps_train, world_size=4, kwargs=dict(steps=6, batch_size=BATCH, mode="async", lr=0.3),
              output="none", timeout=60)
    stale = res.values[0]["staleness"]
    assert len(stale) == 3 * 6 and {w for w, _ in stale} == {1, 2, 3}
    # staleness counts the other workers' updates between a worker's pull and its push: at most all of theirs,
    # (3 - 1) x 6, when this worker is descheduled that long (a loaded machine); any finer bound is a timing claim
    assert min(s for _, s in stale) >= 0 and max(s for _, s in stale) <= (3 - 1) * 6
    assert max(s for _, s in stale) >= 1      # with 3 workers some gradient is always computed on old weights


def _first_come_server(shard, workers, steps, lr):
    """A notebook-style async server (08's async_server): the version rides in each message's last element."""
    version, order = 0, []
    msg = torch.cat([shard, torch.zeros(1)])
    inbox = torch.empty_like(msg)
    for w in workers:
        torch.distributed.send(msg, w)
    for _ in range(len(workers) * steps):
        w = torch.distributed.recv(inbox)
        order.append((w, version - int(inbox[-1])))
        shard -= lr / len(workers) * inbox[:-1]
        version += 1
        msg[:-1], msg[-1] = shard, version
        torch.distributed.send(msg, w)
    return {"order": order}


def test_ps_train_runs_a_server_loop_written_in_a_notebook():
    res = run(ps_train, world_size=3, kwargs=dict(steps=4, batch_size=BATCH, mode="async", lr=0.3,
                                                 server=_first_come_server), output="none", timeout=60)
    order = res.values[0]["order"]
    assert len(order) == 2 * 4 and {w for w, _ in order} == {1, 2} and min(s for _, s in order) >= 0
    assert res.values[0]["traffic"] == []          # the notebook's loop counts no steps
    assert all(len(v["losses"]) == 4 for v in res.values[1:])


def test_buckets_follow_backward_order_and_size():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 10))
    groups = buckets(list(model.parameters()), 2000)
    assert [p.shape for p in groups[0]] == [torch.Size([10]), torch.Size([10, 256])] or groups[0][0].shape == (10,)
    assert sum(len(g) for g in groups) == 4
    assert groups[-1][-1] is list(model.parameters())[0]


def test_shards_by_label_hold_a_few_classes_and_batches_mix_them():
    """worker_batch(by_label=True) (notebook 11b): disjoint shards of about 3 classes, batches drawn across them."""
    from course_lib.training.data import worker_batch

    x, y = load_digits()
    shards = [shard_indices(len(y), w, 4, labels=y) for w in range(4)]
    assert len(set().union(*map(set, (s.tolist() for s in shards)))) == 4 * (len(y) // 4)     # disjoint
    assert all(3 <= len(set(y[s].tolist())) <= 4 for s in shards)
    assert all(len(set(worker_batch(x, y, w, 4, 32, 0, by_label=True)[1].tolist())) >= 2 for w in range(4))
