"""The cost model equals the formulas of REFERENCE.md (Thakur et al. 2005; BytePS) and the fit recovers alpha, beta."""

import math

import pytest

from course_lib import costmodel as cm


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
