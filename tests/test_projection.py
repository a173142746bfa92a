"""One PS model with pipelining as a switch (BytePS, Jiang et al. OSDI'20, section 3.1), the ring next to it, and the
step-time projection of notebook 10 built on both: no launches, formulas only."""

import math

import matplotlib
import pytest

from course_lib.costs import alpha_beta as cm
from course_lib.costs import projection
from course_lib.measure import emulated_link

matplotlib.use("Agg")


@pytest.mark.parametrize("n, k", [(2, 1), (4, 2), (16, 8), (16, 9), (16, 16), (64, 1)])
def test_ps_modes_differ_by_one_direction(n, k):
    m, b = 100e6, 12.5e9
    one_way = max(m / b, n * m / (k * b))          # the busiest NIC, one direction
    pipe = cm.ps_vs_allreduce(n, m, b, k, pipelined=True)
    seq = cm.ps_vs_allreduce(n, m, b, k, pipelined=False)
    assert pipe["ps_s"] == pytest.approx(one_way) and seq["ps_s"] == pytest.approx(2 * one_way)
    assert pipe["allreduce_s"] == seq["allreduce_s"] == pytest.approx(2 * (n - 1) * m / (n * b))
    assert cm.ps_vs_allreduce(n, m, b, k)["ps_s"] == pipe["ps_s"]     # BytePS's analysis is the default


def test_servers_where_the_pipelined_ps_meets_the_ring():
    # k = n/2 gives 2M/B per direction (not M/B); M/B needs k >= n; the ring is matched at k >= n^2 / (2(n-1))
    n, m, b = 16, 100e6, 12.5e9
    assert cm.ps_vs_allreduce(n, m, b, n // 2)["ps_s"] == pytest.approx(2 * m / b)
    assert cm.ps_vs_allreduce(n, m, b, n)["ps_s"] == pytest.approx(m / b)
    ring = cm.ps_vs_allreduce(n, m, b)["allreduce_s"]
    k_min = math.ceil(n * n / (2 * (n - 1)))
    assert cm.ps_vs_allreduce(n, m, b, k_min)["ps_s"] <= ring < cm.ps_vs_allreduce(n, m, b, k_min - 1)["ps_s"]


def test_push_then_pull_never_beats_the_ring_on_bandwidth():
    m, b = 1.0, 1.0
    for n in (2, 3, 8, 64, 1024):
        for k in (1, n // 2 or 1, n, 4 * n):
            assert cm.ps_vs_allreduce(n, m, b, k, pipelined=False)["ps_s"] > cm.ps_vs_allreduce(n, m, b)["allreduce_s"]


def test_step_projection_adds_compute_and_latency():
    lnk = emulated_link.link("1 GbE")
    m = 1e6
    assert projection.ring_step(1, m, lnk) == 0
    assert projection.ring_step(4, m, lnk) == pytest.approx(6 * lnk.alpha + 1.5 * m * lnk.beta)
    assert projection.ps_step(4, m, lnk) == pytest.approx(2 * 4 * m * lnk.beta + 5 * lnk.alpha)
    assert projection.ps_step(4, m, lnk, pipelined=True) == pytest.approx(4 * m * lnk.beta + 5 * lnk.alpha)
    assert projection.ps_step(4, m, lnk, k_servers=4, compute_s=0.5) == pytest.approx(
        0.5 + 2 * m * lnk.beta + 5 * lnk.alpha)


def test_project_names_one_curve_per_k_and_mode():
    lnk = emulated_link.link("100 Gb InfiniBand")
    m, ns = 25.6e6 * 4, [1, 2, 8, 64, 1024]
    curves = projection.project(ns, m, lnk, compute_s=0.1, k_servers=(1, 64), modes=tuple(projection.MODES))
    assert set(curves) == {"ring", "ps k=1 push then pull", "ps k=1 pipelined", "ps k=64 push then pull",
                           "ps k=64 pipelined"}
    for c in curves.values():
        assert c["efficiency"] == pytest.approx([0.1 / t for t in c["step_s"]])
    i = ns.index(64)
    # pipelined with k >= n: M/B per step, less than the ring's ~2M/B; push then pull: 2M/B, more than the ring
    assert curves["ps k=64 pipelined"]["efficiency"][i] > curves["ring"]["efficiency"][i]
    assert curves["ps k=64 push then pull"]["efficiency"][i] < curves["ring"]["efficiency"][i]
    assert curves["ps k=1 pipelined"]["efficiency"][-1] < 0.1
    with pytest.raises(ValueError):
        projection.project(ns, m, lnk, modes=("overlapped",))


def test_scaling_plots_draw_every_curve():
    from course_lib.viz.scaling import plot_efficiency, plot_step_times

    lnk = emulated_link.link("100 MbE")
    curves = projection.project([1, 2, 4], 340_008, lnk, k_servers=(1,), modes=tuple(projection.MODES))
    ax = plot_efficiency(curves)
    assert len(ax.lines) == 3 and {ln.get_linestyle() for ln in ax.lines} == {"-", "--"}
    ax = plot_step_times({"ps k=1": {1: 0.06, 2: 0.09}}, curves)
    assert len(ax.lines) == 4
    matplotlib.pyplot.close("all")
