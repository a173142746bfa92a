"""Bytes per rank per step, counted on every point-to-point message, equal the formulas exactly (BytePS: a single
server receives and sends n*M; ring all-reduce: 2(n-1)/n*M per rank); the emulated link times every
message by the link."""

import pytest
import torch
import torch.distributed as dist

from course_lib import run
from course_lib.costs import projection
from course_lib.measure import emulated_link, traffic
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
    """Run on every rank: its virtual clock after the pattern's messages over `link`."""
    x = torch.zeros(nbytes // 4)
    rank, p = dist.get_rank(), dist.get_world_size()
    with emulated_link.emulate(link):
        if pattern == "incast":          # everyone sends to rank 0
            if rank == 0:
                for r in [dist.irecv(torch.empty_like(x), src) for src in range(1, p)]:
                    r.wait()
            else:
                dist.send(x, 0)
        elif pattern == "fan-out":       # rank 0 sends to everyone, one blocking send after another
            if rank == 0:
                for dst in range(1, p):
                    dist.send(x, dst)
            else:
                dist.recv(x, 0)
        else:                            # rendezvous: rank 1 posts its receive 50 ms late, rank 2 from any rank
            if rank == 0:
                works = [dist.isend(x, 1), dist.isend(x, 2)]
                for w in works:
                    w.wait()
            elif rank == 1:
                emulated_link.compute(0.05)
                dist.recv(x, 0)
            else:
                dist.recv(x)
        return emulated_link.now()


W = 1e-3 + 400_000 / 20e6     # one 400 kB message on the test link: alpha + b/B = 21 ms


@pytest.mark.parametrize("pattern,want", [
    # three messages into rank 0's one incoming side: 21, 41, 61 ms (the alphas overlap, the bytes take turns)
    ("incast", [1e-3 + 3 * 0.02, W, W + 0.02, W + 0.04]),
    # a blocking send ends when its bytes are in, so rank 0's three sends follow each other: 21, 42, 63 ms
    ("fan-out", [3 * W, W, 2 * W, 3 * W]),
    # a send starts only once its receiver has posted (gloo's rendezvous): the message to rank 1 starts at 50 ms,
    # and the one to rank 2, though posted at 0, leaves rank 0's outgoing side after it
    ("rendezvous", [0.05 + 2 * W, 0.05 + W, 0.05 + 2 * W]),
])
def test_the_emulated_link_times_each_message_by_the_link_and_both_sides(pattern, want):
    lnk = emulated_link.Link("slow", 1e-3, 20e6)        # 20 MB/s: 400 kB takes 20 ms
    res = run(_timed_messages, world_size=len(want), args=(lnk, 400_000, pattern), output="none", timeout=60)
    assert res.values == pytest.approx(want, rel=1e-9, abs=1e-12)   # virtual seconds: sums of the same floats


def test_measured_ps_and_ring_steps_sit_on_their_formulas():
    """On the virtual clock with no compute, a step is the schedule's link time: push then pull for the PS,
    2(n-1)(alpha + M/(nB)) for the ring (one element of rounding: chunks differ by at most one float)."""
    from course_lib.bench import scaling

    rows = scaling.measure("100 MbE", workers=(1, 3), steps=2, hidden=64)
    for r in rows:
        assert r["measured_s"] == pytest.approx(r["projected_s"], rel=1e-6), r
    # with compute, the PS's workers compute while the server still sends to the others: with n = 3 and 10 ms of
    # compute (more than the (n-1)(alpha + M/B) = 5.9 ms of the later sends) the gradients of the first n - 1 no
    # longer arrive back to back, and the step is compute + (n+1)(alpha + M/B), (n-1) M/B under the formula
    lnk = emulated_link.link("100 MbE")
    (ps3,) = scaling.measure("100 MbE", workers=(3,), steps=2, hidden=64, compute_s=0.01, archs=("ps",))
    assert ps3["arch"] == "ps"
    m = ps3["model_bytes"]
    assert ps3["measured_s"] == pytest.approx(0.01 + 4 * (lnk.alpha + m * lnk.beta), rel=1e-9)
    assert ps3["projected_s"] - ps3["measured_s"] == pytest.approx(2 * m * lnk.beta, rel=1e-6)


def test_emulate_does_not_nest_and_times_compute_on_the_virtual_clock():
    def body():
        with emulated_link.emulate("1 GbE"):
            emulated_link.compute(2.5)
            t = emulated_link.now()
            with pytest.raises(RuntimeError, match="do not nest"):
                with emulated_link.emulate("1 GbE"):
                    pass
        return t, emulated_link.virtual()
    assert run(body, world_size=2, output="none", timeout=30).values == [(2.5, False)] * 2


def test_links_and_projection_use_the_cost_model():
    lnk = emulated_link.link("1 GbE")
    assert lnk.bandwidth == 125e6 and emulated_link.link("100 Gb InfiniBand").bandwidth == 12.5e9
    m = 1e6
    assert projection.ring_step(1, m, lnk) == 0
    assert projection.ring_step(4, m, lnk) == pytest.approx(6 * lnk.alpha + 1.5 * m * lnk.beta)
    assert projection.ps_step(4, m, lnk) == pytest.approx(2 * 4 * m * lnk.beta + 5 * lnk.alpha)
    assert projection.ps_step(4, m, lnk, k_servers=4) == pytest.approx(2 * m * lnk.beta + 5 * lnk.alpha)
    curves = projection.project([1, 2, 1024], m, lnk, compute_s=0.01)
    assert curves["ring"]["efficiency"][0] == 1 and curves["ps k=1 push then pull"]["efficiency"][-1] < 0.01


def _piecewise_server(shard, workers, steps, lr, pieces=4):
    """Notebook 10's pipelined server: piece i goes back to every worker while piece i + 1 still comes in."""
    from course_lib.collectives import chunk_bounds
    grads = [torch.empty_like(shard) for _ in workers]
    for r in [dist.isend(shard, w) for w in workers]:
        r.wait()
    for _ in range(steps):
        parts = chunk_bounds(shard.numel(), pieces)
        pushes = [[dist.irecv(g[a:b], w) for g, w in zip(grads, workers)] for a, b in parts]
        pulls = []
        for (a, b), piece in zip(parts, pushes):
            for r in piece:
                r.wait()
            shard[a:b] -= lr * torch.stack([g[a:b] for g in grads]).mean(0)
            pulls += [dist.isend(shard[a:b], w) for w in workers]
        for r in pulls:
            r.wait()


def test_pieces_bring_a_ps_step_to_the_pipelined_line_plus_the_first_piece():
    """With P pieces the server's two sides overlap: a step is max(M/B, nM/B) + (1 + n) alpha (the pipelined line)
    plus the first piece from every worker, n M/(P B), plus the (P - 1) n further messages' alpha; and the weights
    are the built-in server's (the same mean, piece by piece: float32 sums in the same order, so 1e-6 covers it)."""
    from course_lib.training.tolerance import max_diff
    lnk, P, n = emulated_link.link("100 MbE"), 4, 3
    vals = run(ps_train, world_size=n + 1, kwargs=dict(steps=2, hidden=64, link=lnk, server=_piecewise_server,
                                                      pieces=P), output="none", timeout=60).values
    m = vals[0]["model_bytes"]
    want = projection.ps_step(n, m, lnk, 1, 0.0, True) + n * m * lnk.beta / P + n * (P - 1) * lnk.alpha
    assert max(v["step_s"][-1] for v in vals[1:]) == pytest.approx(want, rel=1e-3)
    plain = run(ps_train, world_size=n + 1, kwargs=dict(steps=2, hidden=64), output="none", timeout=60).values
    assert max(max_diff(a["params"], b["params"]) for a, b in zip(vals[1:], plain[1:])) <= 1e-6
    with pytest.raises(Exception, match="pieces > 1 needs"):     # named in the RankFailed that run raises
        run(ps_train, world_size=2, kwargs=dict(steps=1, pieces=2), output="none", timeout=30)


def test_link_busy_shows_push_then_pull_taking_turns_and_pieces_overlapping():
    """emulated_link.link_busy: the server's two sides never overlap push then pull, do with pieces (notebook 10)."""
    from course_lib.training import make_mlp

    def overlap(busy):
        return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1, _ in busy["out"] for s2, e2, _ in busy["in"])

    lnk, n = emulated_link.link("100 MbE"), 3
    plain = run(ps_train, world_size=n + 1, kwargs=dict(steps=1, hidden=64, link=lnk), output="none",
                timeout=60).values[0]["link_busy"]
    assert len(plain["out"]) == 2 * n and len(plain["in"]) == n and overlap(plain) == 0.0
    m = 4 * sum(q.numel() for q in make_mlp(64).parameters())
    assert all(e - s == pytest.approx(m / lnk.bandwidth, rel=1e-9) for s, e, _ in plain["in"])   # bytes only
    pieces = run(ps_train, world_size=n + 1, kwargs=dict(steps=1, hidden=64, link=lnk, server=_piecewise_server,
                                                         pieces=4), output="none", timeout=60).values[0]["link_busy"]
    assert overlap(pieces) > 0.5 * sum(e - s for s, e, _ in pieces["in"])
