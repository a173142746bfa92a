"""Timelines: labelled profiler regions come back per rank in the three lanes, aligned at the barrier, and the
Chrome trace holds one process per rank with complete events (the format Perfetto and chrome://tracing load)."""

import json

from course_lib import run
from course_lib.measure.timeline import LANES, busy, chrome_trace
from course_lib.training.allreduce import dp_train
from course_lib.training.ps import ps_train


def test_ps_timeline_lanes_and_chrome_trace(tmp_path):
    res = run(ps_train, world_size=3, kwargs=dict(steps=2, hidden=32, profile=True), output="none", timeout=60)
    lanes = [v["timeline"] for v in res.values]
    server, worker = {e[1] for e in lanes[0]}, {e[1] for e in lanes[1]}
    assert {"send params", "gather grads", "update"} <= server
    assert {"forward+backward", "push grads", "pull"} <= worker
    for events in lanes:
        assert {e[0] for e in events} == set(LANES)
        assert all(-0.05 < s <= e for _, _, s, e in events)      # t = 0 is the common barrier
        assert busy(events, "compute") > 0
    path = chrome_trace(lanes, str(tmp_path / "trace.json"))
    trace = json.load(open(path))["traceEvents"]
    assert {e["pid"] for e in trace} == {0, 1, 2}
    xs = [e for e in trace if e["ph"] == "X"]
    assert len(xs) == sum(len(v) for v in lanes) and all(e["dur"] >= 0 and e["ts"] > -5e4 for e in xs)


def test_ddp_timeline_shows_torch_all_reduce():
    res = run(dp_train, world_size=2, kwargs=dict(steps=2, hidden=32, method="ddp", profile=True),
              output="none", timeout=60)
    for v in res.values:
        assert any(lane == "comm" and "all_reduce" in name for lane, name, _, _ in v["timeline"])


def test_busy_counts_nested_regions_once():
    events = [("comm", "a", 0.0, 1.0), ("comm", "b", 0.5, 0.8), ("comm", "c", 0.9, 1.5), ("wait", "w", 0, 9)]
    assert abs(busy(events, "comm") - 1.5) < 1e-12


def test_plot_lanes_marks_a_moment_across_every_rank():
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.viz.timeline import plot_lanes

    lanes = [[("comm", "send", 0.0, 0.3)], [("wait", "pull", 0.25, 0.3)]]
    ax = plot_lanes(lanes, marks={"all workers ready": 0.25})
    assert [line.get_xdata()[0] for line in ax.lines] == [250.0]
    assert any(t.get_text().strip() == "all workers ready" for t in ax.texts)
    matplotlib.pyplot.close("all")


def test_regions_only_timeline_times_the_regions_without_the_profiler():
    """Timeline(torch_ops=False), notebook 14's pipeline stages: the regions on time.perf_counter, nested ones too,
    and nothing of torch's own ops; Timeline(False) records nothing."""
    import torch

    from course_lib.measure.timeline import Timeline, region

    with Timeline(torch_ops=False) as tl:
        with region("compute", "F"):
            with region("comm", "inner"):
                torch.ones(8).sum()
        with region("wait", "w"):
            pass
    assert [e[:2] for e in tl.events] == [("compute", "F"), ("comm", "inner"), ("wait", "w")]
    (_, _, f0, f1), (_, _, i0, i1), (_, _, w0, w1) = tl.events
    assert 0 <= f0 <= i0 <= i1 <= f1 <= w0 <= w1 < 5
    with Timeline(False, torch_ops=False) as off:
        with region("compute", "F"):
            pass
    assert off.events == []
