"""The cost model equals the published formulas (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009; BytePS,
Jiang et al. OSDI'20), the fits recover alpha and beta, and alpha + beta n predicts a published nccl-tests sweep."""

import math

import pytest

from course_lib.costs import alpha_beta as cm
from course_lib.costs import hardware as hw


def test_lg_is_rounds_of_a_binomial_tree():
    assert [cm.lg(p) for p in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]


@pytest.mark.parametrize("p", [2, 4, 8])
def test_formulas_match_reference(p):
    a, b, g, n = 1e-5, 1e-9, 2e-10, 64 * 2**20
    k = math.log2(p)
    ring = 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    assert cm.ring_allreduce(p, n, a, b, g) == pytest.approx(ring)
    assert cm.recursive_doubling_allreduce(p, n, a, b, g) == pytest.approx(k * a + n * k * b + n * k * g)
    rabenseifner = 2 * k * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    assert cm.rabenseifner_allreduce(p, n, a, b, g) == pytest.approx(rabenseifner)
    assert cm.tree_allreduce(p, n, a, b, g) == pytest.approx(2 * k * a + 2 * n * k * b + n * k * g)
    assert cm.star_allreduce(p, n, 0, b) == pytest.approx(2 * (p - 1) * n * b)  # the root's link carries 2(p-1)n
    # all-reduce = reduce-scatter + all-gather (ring)
    assert cm.ring_allreduce(p, n, a, b, g) == pytest.approx(
        cm.ring_reduce_scatter(p, n, a, b, g) + cm.ring_all_gather(p, n, a, b))


def test_ring_is_bandwidth_optimal_and_tree_is_not():
    n = 2**26
    for p in (2, 4, 8, 16):
        assert cm.allreduce_traffic("ring", p, n)["busiest"] <= cm.allreduce_traffic("tree", p, n)["busiest"]
        assert cm.allreduce_traffic("ring", p, n)["total"] == cm.allreduce_traffic("tree", p, n)["total"]
    assert cm.tree_over_ring_ratio(4) == pytest.approx(2 * 2 / 1.5)
    assert cm.tree_over_ring_ratio(2) == pytest.approx(2.0)


def test_ring_loses_on_latency_at_many_ranks():
    # small message, many ranks: 2(p-1) alpha >> 2 lg p alpha
    assert cm.ring_allreduce(256, 1024, 1e-5, 1e-10) > cm.rabenseifner_allreduce(256, 1024, 1e-5, 1e-10)


def test_ps_vs_allreduce_bytes():
    r = cm.ps_vs_allreduce(n_workers=8, model_bytes=100e6, bandwidth=10e9, k_servers=1)
    assert r["allreduce_s"] == pytest.approx(2 * 7 * 100e6 / (8 * 10e9))
    assert r["ps_s"] == pytest.approx(8 * 100e6 / 10e9)
    assert r["ps_server_bytes_in"] == r["ps_server_bytes_out"] == 8 * 100e6
    assert cm.ps_vs_allreduce(8, 100e6, 10e9, k_servers=8)["ps_s"] == pytest.approx(100e6 / 10e9)


@pytest.mark.parametrize("p", [2, 4])
def test_fit_recovers_alpha_beta(p):
    alpha, beta = 50e-6, 1 / 1.0e9
    sizes = [2**k for k in range(12, 27)]
    times = [cm.ring_allreduce(p, n, alpha, beta) for n in sizes]
    a, b = cm.fit_alpha_beta(sizes, times, p=p)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_fit_never_negative():
    a, b = cm.fit_alpha_beta([1000, 2000, 4000], [3e-3, 2e-3, 1e-3], p=2)
    assert a >= 0 and b >= 0
    with pytest.raises(ValueError):
        cm.fit_alpha_beta([1000], [1e-3])


def test_rabenseifner_is_never_slower_than_the_ring_for_powers_of_two_but_its_fold_is_for_large_tensors():
    # The alpha-beta model's own verdict (notebook 06): same bandwidth term, 2 lg p <= 2 (p - 1) latencies.
    for p in (2, 4, 8, 64, 1024):
        for n in (4 << 10, 64 << 20):
            assert cm.rabenseifner_allreduce(p, n, 5e-6, 1 / 25e9) <= cm.ring_allreduce(p, n, 5e-6, 1 / 25e9)
    # p = 6: MPICH's fold costs (2 floor(lg p) + 2) alpha + (2 (p-1)/p + 2) n beta; the ring wins at 64 MiB
    a, b, n = 5e-6, 1 / 25e9, 64 << 20
    assert cm.rabenseifner_allreduce(6, n, a, b) == pytest.approx(6 * a + (2 * 5 / 6 + 2) * n * b)
    assert cm.ring_allreduce(6, n, a, b) < cm.rabenseifner_allreduce(6, n, a, b) / 2
    assert cm.rabenseifner_allreduce(6, 64, a, b) < cm.ring_allreduce(6, 64, a, b)      # and loses on tiny ones


def test_line_and_pieces_recover_what_generated_them():
    sizes = [2.0**k for k in range(10, 30)]
    a1, b1, a2, b2 = 10e-6, 1 / 100e9, 40e-6, 1 / 250e9
    times = [a1 + b1 * s if s < 2**20 else a2 + b2 * s for s in sizes]
    a, b = cm.fit_line(sizes[:10], times[:10])
    assert a == pytest.approx(a1, rel=1e-9) and b == pytest.approx(b1, rel=1e-9)
    pieces = cm.fit_pieces(sizes, times, tol=1e-6)
    assert [(pc["lo"], pc["hi"]) for pc in pieces] == [(2.0**10, 2.0**19), (2.0**20, 2.0**29)]
    assert cm.predict_pieces(pieces, 2.0**25) == pytest.approx(a2 + b2 * 2.0**25)
    assert cm.fit_pieces(sizes, times, breaks=[2**20])[1]["alpha"] == pytest.approx(a2, rel=1e-9)


def test_published_nccl_sweep_is_alpha_plus_beta_n_within_25_percent_in_two_pieces():
    rows = hw.nccl_sweep()
    sizes, times = [r["size_bytes"] for r in rows], [r["time_s"] for r in rows]
    assert len(rows) == 20 and sizes[0] == 32 << 10 and sizes[-1] == 16 << 30
    # Every row: busbw = algbw x 2(n-1)/n, algbw = S / t (nccl-tests doc/PERFORMANCE.md).
    assert all(r["busbw_GBps"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9 * 2 * 7 / 8) for r in rows)
    # One line over 32 KiB .. 16 GiB misses by more than 25% somewhere: the model bends.
    a, b = cm.fit_line(sizes, times)
    assert max(abs(a + b * s - t) / t for s, t in zip(sizes, times)) > 0.25
    # Split where the source reports NCCL switching from Ring/LL to NVLS/Simple (between 1 and 2 MiB): every size
    # within 25%, and the fit needs exactly two pieces at that tolerance.
    pieces = cm.fit_pieces(sizes, times, breaks=[2 << 20])
    assert max(pc["max_rel_err"] for pc in pieces) < 0.25
    assert all(abs(cm.predict_pieces(pieces, s) - t) / t < 0.25 for s, t in zip(sizes, times))
    assert len(cm.fit_pieces(sizes, times, tol=0.25)) == 2
    small, large = pieces
    assert 10e-6 < small["alpha"] < 30e-6                      # tens of microseconds of latency
    assert 450 < 1 / large["beta"] / 1e9 * 2 * 7 / 8 < 500     # asymptotic busbw above the 450 GB/s NVLink line rate


def test_hierarchical_allreduce_is_a_ring_inside_and_a_ring_across_on_a_1_over_g_shard():
    a_in, b_in, a_out, b_out, n = 3e-6, 1 / 450e9, 5e-6, 1 / 50e9, 100e6
    # one node: only the inside rings; one GPU per node: a plain ring across the nodes
    assert cm.hierarchical_allreduce(1, 8, n, a_in, b_in, a_out, b_out) == pytest.approx(
        cm.ring_allreduce(8, n, a_in, b_in))
    assert cm.hierarchical_allreduce(16, 1, n, a_in, b_in, a_out, b_out) == pytest.approx(
        cm.ring_allreduce(16, n, a_out, b_out))
    # 128 nodes of 8: the slow links carry n/8, and the latency is 2(8-1) fast + 2(128-1) slow hops, not 2(1024-1)
    t = cm.hierarchical_allreduce(128, 8, n, a_in, b_in, a_out, b_out)
    want = 14 * a_in + 2 * 7 / 8 * n * b_in + 254 * a_out + 2 * 127 / 128 * n / 8 * b_out
    assert t == pytest.approx(want)
    assert t < cm.ring_allreduce(1024, n, a_out, b_out) / 4
