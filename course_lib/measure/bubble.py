"""The pipeline bubble measured on the ranks' timelines (notebook 14): each rank's forwards and backwards as recorded,
its idle share of the step on the wall clock, and what the ideal clock leaves out, read off the same timelines and
replayed: every action as long as it took, every hand-off as long as hand-offs took (course_lib.training.pipeline
records the timelines; pipeline_schedules.simulate replays them).
"""

from __future__ import annotations

import statistics

from ..training.pipeline_schedules import simulated_bubble
from .timeline import busy


def actions(events) -> list[tuple[str, int, float, float]]:
    """A rank's Timeline events as its schedule: [(kind, micro-batch, start, end)] for each F and B region, numbered
    in the order they ran (both schedules run the forwards in order 0..m-1, and the backwards too)."""
    seen = {"F": 0, "B": 0}
    out = []
    for lane, name, start, end in events:
        if lane == "compute" and name in seen:
            out.append((name, seen[name], start, end))
            seen[name] += 1
    return out


def measured_bubble(per_rank: list) -> list[float]:
    """Each rank's idle share of the step from its Timeline events: 1 - (its time in the compute lane) / (the step,
    from the common barrier to the end of the last compute on any rank)."""
    span = max(e for events in per_rank for lane, _, _, e in events if lane == "compute")
    return [1 - busy(events, "compute") / span for events in per_rank]


def hand_off_costs(per_rank: list) -> dict:
    """What the ideal clock leaves out, read off a run's timelines (per_rank[s] = stage s's Timeline events):
    "message", the mean time from a sender finishing an action to the receiver, already waiting, starting the
    dependent one (the send, the receive, waking the receiver), and "between", the mean time from the step's start or
    a stage's previous action to its next one when its input was already there (the Python of the step function:
    receives, sends, the loss). Each rank's clock starts when it left the common barrier, a little earlier or later
    than its neighbour's: a forward hand-off looks longer by that offset and a backward one shorter by as much, so
    each pair of neighbours' message time is the mean of its two directions (as NTP cancels a clock offset)."""
    acts = [actions(events) for events in per_rank]
    p, ends = len(acts), {}
    for s, a in enumerate(acts):
        for kind, i, _, end in a:
            ends[kind, s, i] = end
    between, links = [], {}
    for s, a in enumerate(acts):
        prev = 0.0
        for kind, i, start, end in a:
            dep = ("F", s - 1, i) if kind == "F" else ("B", s + 1, i) if s < p - 1 else None
            if dep in ends and ends[dep] > prev:
                link = min(s, dep[1])                  # the pair (link, link + 1); forward or backward over it
                links.setdefault(link, {"F": [], "B": []})[kind].append(start - ends[dep])
            else:
                between.append(start - prev)
            prev = end
    per_link = [statistics.mean(statistics.mean(g) for g in d.values() if g) for d in links.values()]
    return {"message": statistics.mean(per_link) if per_link else 0.0,
            "between": statistics.mean(between) if between else 0.0}


def replayed_with_costs(per_rank: list, costs: dict | None = None) -> list[float]:
    """Each stage's bubble had the run been timed by its schedule and its measured costs alone: the recorded order
    replayed with every action as long as it was measured (the real layers, the emulated time and its overshoot) and
    hand_off_costs' mean message and between-action times. The wall clock differs from it by how unevenly those
    costs fell: a rank woken late on the critical path delays every stage after it."""
    acts = [actions(events) for events in per_rank]
    costs = costs or hand_off_costs(per_rank)
    return simulated_bubble([[(k, i) for k, i, _, _ in a] for a in acts], message=costs["message"],
                            between=costs["between"], durations=[[e - s for _, _, s, e in a] for a in acts])
