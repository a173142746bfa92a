"""Per-rank timelines from torch's profiler: labelled regions -> lanes of compute, communication and waiting.

Taught in notebooks/08-10. Trainers wrap their phases in `region("compute" | "comm" | "wait", name)`, which is
torch.profiler.record_function with a "lane:name" label (free when nothing records). `Timeline` records them with
torch's autograd profiler in its non-kineto mode: same record_function events, but starting kineto costs ~3.4 s per
process on the course machine and every rank is a fresh process. Ranks align on a barrier: t = 0 is when every rank
left it. Inside emulated_link.emulate(link) the regions are timed on the link's virtual clock instead (t = 0: the
block's start). `Timeline(torch_ops=False)` times only the regions, on time.perf_counter, without the profiler: for a
caller that draws nothing but its own regions (notebook 14's pipeline stages): the profiler also records every torch
op and reads them all back (a step of 8 micro-batches on 4 pipeline ranks sharing 2 cores took 0.35 s with it,
0.08 s without).
`chrome_trace` writes all ranks into one Chrome trace JSON (one process per rank) that opens in Perfetto.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import emulated_link

LANES = ("compute", "comm", "wait")
# torch's own all-reduces (DDP's buckets, dist.all_reduce) show up under these names.
_TORCH_COMM = ("gloo:all_reduce", "nccl:all_reduce")


# (events, clock) of a Timeline that times the regions itself: on the emulated link's virtual clock or on
# time.perf_counter
_VIRTUAL: list = []


@contextmanager
def region(lane: str, name: str):
    """A labelled region (context manager) drawn in lane `lane` (compute, comm or wait)."""
    if lane not in LANES:
        raise ValueError(f"lane must be one of {LANES}, got {lane!r}")
    if not _VIRTUAL:
        with record_function(f"{lane}:{name}"):
            yield
        return
    events, clock = _VIRTUAL[-1]
    start = clock()
    try:
        yield
    finally:
        events.append((lane, name, start, clock()))


class Timeline:
    """`with Timeline(): ...` records this rank's regions; afterwards `.events` is a list of
    (lane, name, start_s, end_s) with t = 0 at the common barrier. Timeline(False) records nothing.
    `torch_ops=False`: the regions only, timed on time.perf_counter without torch's profiler (torch's own
    collectives, which only the profiler sees, are then left out)."""

    def __init__(self, enabled: bool = True, torch_ops: bool = True):
        self.enabled, self.torch_ops, self.events, self._prof = enabled, torch_ops, [], None

    def __enter__(self):
        if self.enabled and emulated_link.virtual():   # inside emulate(link): regions are timed on the virtual clock
            _VIRTUAL.append((self.events, emulated_link.now))
            return self
        if self.enabled and not self.torch_ops:
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            _VIRTUAL.append((self.events, lambda: time.perf_counter() - t0))
            return self
        if self.enabled:
            self._prof = torch.autograd.profiler.profile(use_kineto=False)
            self._prof.__enter__()
            if dist.is_initialized():
                dist.barrier()
            with record_function("timeline:t0"):
                pass
        return self

    def __exit__(self, *exc):
        if _VIRTUAL and _VIRTUAL[-1][0] is self.events:
            _VIRTUAL.pop()
            self.events.sort(key=lambda ev: ev[2])
            return False
        if self._prof is None:
            return False
        self._prof.__exit__(*exc)
        evs = self._prof.function_events
        t0 = next(e.time_range.start for e in evs if e.name == "timeline:t0")
        for e in evs:
            lane, _, name = e.name.partition(":")
            if lane in LANES and name:
                pass
            elif e.name.startswith(_TORCH_COMM):
                lane, name = "comm", e.name
            else:
                continue
            self.events.append((lane, name, (e.time_range.start - t0) * 1e-6, (e.time_range.end - t0) * 1e-6))
        self.events.sort(key=lambda ev: ev[2])
        return False


def busy(events: list, lane: str) -> float:
    """Seconds a rank spent in `lane` (outermost regions only, so nested ones are not counted twice)."""
    total, end = 0.0, -1.0
    for _, _, s, e in sorted((ev for ev in events if ev[0] == lane), key=lambda ev: ev[2]):
        if s >= end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def chrome_trace(per_rank: list, path: str) -> str:
    """Write the ranks' events (per_rank[r] = that rank's Timeline.events) as one Chrome trace JSON file:
    one process per rank, one thread per lane, complete ('X') events in microseconds. Open it in ui.perfetto.dev."""
    trace = []
    for rank, events in enumerate(per_rank):
        trace.append({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}})
        for tid, lane in enumerate(LANES):
            trace.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_name", "args": {"name": lane}})
        for lane, name, s, e in events:
            trace.append({"ph": "X", "pid": rank, "tid": LANES.index(lane), "name": name, "cat": lane,
                          "ts": s * 1e6, "dur": max(e - s, 0.0) * 1e6})
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    return path
