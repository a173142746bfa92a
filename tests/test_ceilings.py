"""Sanity (not speed) of course_lib.bench.ceilings: the keys another benchmark relies on, finite positive rates."""

import math

import torch

from course_lib.bench import ceilings


def test_measure_ceilings_keys_and_sanity():
    res = ceilings.measure_ceilings(seconds=0.1)
    assert set(res) == {"memcpy_GBps", "loopback_tcp_GBps", "h2d_GBps", "d2h_GBps", "d2d_GBps", "p2p_GBps"}
    for k in ("memcpy_GBps", "loopback_tcp_GBps"):
        assert math.isfinite(res[k]) and 0.01 < res[k] < 10_000, (k, res[k])
    if torch.cuda.device_count() == 0:
        assert res["h2d_GBps"] is None and res["d2d_GBps"] is None and res["p2p_GBps"] is None


def test_loopback_leaves_no_thread_behind():
    import threading

    before = threading.active_count()
    ceilings.loopback_tcp_GBps(seconds=0.05, chunk=1 << 20)
    assert threading.active_count() == before


def test_repeat_reports_median_rate():
    # a callable that "moves" 1e9 bytes: the rate is finite and positive whatever the clock says
    assert ceilings._repeat(lambda: None, 10**9, 0.0) > 0
