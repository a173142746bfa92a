"""Bytes per rank per step, counted on every point-to-point message, equal the formulas exactly (BytePS: a single
server receives and sends n*M; ring all-reduce: 2(n-1)/n*M per rank); netem delays are at least the link's."""

import time

import pytest
import torch
import torch.distributed as dist

from course_lib import run
from course_lib.costs import projection
from course_lib.measure import netem, traffic
from course_lib.training.allreduce import dp_train
from course_lib.training.ps import ps_train


@pytest.mark.parametrize("n,k", [(2, 1), (3, 1), (4, 2)])
def test_ps_traffic_matches_formula(n, k):
    res = run(ps_train, world_size=n + k, kwargs=dict(steps=2, batch_size=8, n_servers=k, hidden=64),
              output="none", timeout=60)
    m = res.values[0]["model_bytes"]
    want = traffic.expected("ps", n, m, k)
    n_params = m // 4
    for s in range(k):
        shard_bytes = (n_params // k + (1 if s < n_params % k else 0)) * 4
        assert res.values[s]["traffic"] == [(n * shard_bytes, n * shard_bytes)] * 2
    if n_params % k == 0:
        assert res.values[0]["traffic"][0] == (want["server_sent"], want["server_recv"])
    for w in range(k, n + k):
        assert res.values[w]["traffic"] == [(want["worker_sent"], want["worker_recv"])] * 2


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_traffic_matches_formula(n):
    # hidden=60: 64*60+60 + 60*60+60 + 60*10+10 = 8170 floats; chunks differ by at most one element
    res = run(dp_train, world_size=n, kwargs=dict(steps=2, batch_size=8, hidden=60, method="bucket",
                                                 collective="ring", bucket_bytes=1 << 30), output="none", timeout=60)
    m = res.values[0]["model_bytes"]
    per_rank = traffic.expected("ring", n, m)["rank_sent"]
    for v in res.values:
        for sent, recv in v["traffic"]:
            assert abs(sent - per_rank) <= 2 * 4 and abs(recv - per_rank) <= 2 * 4   # one element per phase
    assert sum(v["traffic"][0][0] for v in res.values) == 2 * (n - 1) * m          # exact in total


def _timed_messages(link, nbytes, pattern):
    x = torch.zeros(nbytes // 4)
    rank, p = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    t = time.perf_counter()
    with netem.emulate(link):
        if pattern == "incast":          # everyone sends to rank 0
            if rank == 0:
                for r in [dist.irecv(torch.empty_like(x), src) for src in range(1, p)]:
                    r.wait()
            else:
                dist.send(x, 0)
        else:                            # rank 0 sends to everyone, one after another
            if rank == 0:
                for dst in range(1, p):
                    dist.send(x, dst)
            else:
                dist.recv(x, 0)
    dist.barrier()
    return time.perf_counter() - t


@pytest.mark.parametrize("pattern", ["incast", "fan-out"])
def test_netem_serialises_the_busy_link(pattern):
    lnk = netem.Link("slow", 1e-3, 20e6)        # 20 MB/s: 400 kB takes 20 ms
    res = run(_timed_messages, world_size=4, args=(lnk, 400_000, pattern), output="none", timeout=30)
    floor = 3 * 400_000 * lnk.beta               # three messages through rank 0's one link
    assert min(res.values) >= floor


def test_links_and_projection_use_the_cost_model():
    lnk = netem.link("1 GbE")
    assert lnk.bandwidth == 125e6 and netem.link("100 Gb InfiniBand").bandwidth == 12.5e9
    m = 1e6
    assert projection.ring_step(1, m, lnk) == 0
    assert projection.ring_step(4, m, lnk) == pytest.approx(6 * lnk.alpha + 1.5 * m * lnk.beta)
    assert projection.ps_step(4, m, lnk) == pytest.approx(2 * 4 * m * lnk.beta + 5 * lnk.alpha)
    assert projection.ps_step(4, m, lnk, k_servers=4) == pytest.approx(2 * m * lnk.beta + 5 * lnk.alpha)
    curves = projection.project([1, 2, 1024], m, lnk, compute_s=0.01)
    assert curves["ring"]["efficiency"][0] == 1 and curves["ps k=1 push then pull"]["efficiency"][-1] < 0.01
