"""ZeRO-3's forward with prefetch on the emulated link (notebook 12, section 10): the sharded forward gives the
unsharded output exactly, each all-gather takes (p - 1)(alpha + shard/B) on the clock, the forward without prefetch
is the sum of every gather and compute, with prefetch each layer's compute runs beside the next layer's gather
(the first gather and the last compute exposed), and prefetch holds two layers' full weights instead of one."""

import matplotlib
import pytest

from course_lib import run
from course_lib.measure import emulated_link
from course_lib.training import prefetch

matplotlib.use("Agg")

CASES = [(2, [96, 96, 96], [0.004] * 3, "1 GbE"),
         (3, [120, 480, 60, 240, 30], [0.002, 0.012, 0.003, 0.001, 0.006], "100 MbE"),
         (4, [256, 10], [0.001, 0.001], "100 MbE")]        # 10 rows over 4 ranks: padded shards


@pytest.mark.parametrize("p, widths, compute_s, link", CASES, ids=lambda v: str(v))
def test_forward_times_follow_the_link_and_the_schedule(p, widths, compute_s, link):
    vals = run(prefetch.forward_times, p, args=(widths, compute_s, link), backend="gloo", output="none",
               timeout=60).values
    lnk = emulated_link.link(link)
    r = vals[0]
    assert all(v["no_prefetch"]["seconds"] == r["no_prefetch"]["seconds"] for v in vals)   # symmetric ranks
    assert all(v[k]["exact"] for v in vals for k in ("no_prefetch", "prefetch"))
    dims = [prefetch.IN_FEATURES, *widths]
    want_a = [prefetch.gather_seconds(k * d_in * 4, p, lnk) for k, d_in in zip(r["shard_rows"], dims)]
    a, c = r["gather_s"], compute_s
    # a few float64 additions on the clock: 1e-12 s is far above their rounding (~1e-18 s)
    assert a == pytest.approx(want_a, abs=1e-12)
    assert r["no_prefetch"]["seconds"] == pytest.approx(sum(a) + sum(c), abs=1e-12)
    pace = a[0] + sum(max(c[i], a[i + 1]) for i in range(len(a) - 1)) + c[-1]
    assert r["prefetch"]["seconds"] == pytest.approx(pace, abs=1e-12)
    full = [k * p * d_in * 4 for k, d_in in zip(r["shard_rows"], dims)]        # padded full weights' bytes
    assert r["no_prefetch"]["peak_bytes"] == max(full)
    assert r["prefetch"]["peak_bytes"] == max(x + y for x, y in zip(full, full[1:]))


def test_the_drawing_names_every_block():
    from course_lib.viz.prefetch import plot_prefetch

    events = [("wait", "layer 0's weight", 0.0, 0.001), ("comm", "all-gather 0", 0.0, 0.001),
              ("compute", "layer 0", 0.001, 0.005), ("wait", "layer 1's weight", 0.005, 0.005)]
    ax = plot_prefetch({"prefetch": events}, title="t")
    assert sorted(t.get_text() for t in ax.texts) == ["AG0", "L0"]     # the zero-length wait is not drawn
