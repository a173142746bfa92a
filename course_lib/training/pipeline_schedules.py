"""Pipeline schedules as orders of forwards and backwards, their bubble and memory, and an ideal clock (notebook 14).

GPipe (Huang et al., NeurIPS 2019, section 2.2): every forward, then every backward. 1F1B (PipeDream-Flush, Narayanan
et al., ICML 2021; Megatron-LM, Narayanan et al. SC'21, section 2.2.1): min(p - s - 1, m) warm-up forwards on stage
s, then one forward and one backward in turn, then the backwards left. `simulate` runs every stage's order on an
ideal clock (forward 1 slot, backward 2, messages free), so a schedule's bubble and memory can be read off exactly,
and a deadlock is found without starting a rank; given a run's measured action times and message latency it replays
that run as the schedule alone would have timed it.
"""

from __future__ import annotations

from fractions import Fraction


def gpipe_order(stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """GPipe: every micro-batch's forward, then every backward (the same on every stage)."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """1F1B (PipeDream-Flush): min(p - stage - 1, m) warm-up forwards, then F, B in turn, then the last backwards."""
    warm = min(p - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


SCHEDULES = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}


def bubble_formula(p: int, m: int) -> Fraction:
    """Share of a step each stage idles, exactly, when every forward takes the same time, every backward too, and
    messages are free: (p - 1) / (m + p - 1) (GPipe, section 2.3). Megatron-LM (SC'21, section 2.2.1) writes the same
    bubble as (p - 1) / m of the ideal, bubble-free time."""
    return Fraction(p - 1, m + p - 1)


def in_flight_formula(schedule: str, stage: int, p: int, m: int) -> int:
    """Micro-batches whose activations a stage holds at its peak: GPipe m, 1F1B min(p - stage, m)."""
    return m if schedule == "gpipe" else min(p - stage, m)


def peak_in_flight(order) -> int:
    """Most forwards not yet matched by their backward at any point of a stage's order."""
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(orders: list, fwd=1, bwd=2, message=0, between=0, durations: list | None = None) -> list[list[tuple]]:
    """Run every stage's order on a clock: F i on stage s waits for F i on s-1, B i for B i on s+1. The ideal clock
    (the defaults): forward `fwd` slots, backward `bwd`, nothing else costs time. To replay a measured run:
    `durations[s][k]` the length of stage s's k-th action, `message` the time from a sender finishing to the waiting
    receiver starting, `between` the time from the step's start or a stage's previous action to its next one when
    its input is there. Returns per stage
    [(kind, i, start, end)]; raises on a deadlock."""
    p = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    pos, free, out = [0] * p, [0] * p, [[] for _ in range(p)]
    while any(pos[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            kind, i = orders[s][pos[s]]
            dep = ("F", s - 1, i) if kind == "F" and s > 0 else ("B", s + 1, i) if kind == "B" and s < p - 1 else None
            if kind == "B" and s == p - 1:
                dep = ("F", s, i)              # the last stage's backward starts from its own forward's loss
            if dep is not None and dep not in done:
                continue
            arrives = 0 if dep is None else done[dep] + (message if dep[1] != s else between)
            start = max(free[s] + between, arrives)
            length = durations[s][pos[s]] if durations is not None else (fwd if kind == "F" else bwd)
            end = start + length
            done[(kind, s, i)] = free[s] = end
            out[s].append((kind, i, start, end))
            pos[s] += 1
            moved = True
        if not moved:
            stuck = {s: orders[s][pos[s]] for s in range(p) if pos[s] < len(orders[s])}
            raise RuntimeError(f"the schedule deadlocks: each stage waits for another (next actions {stuck})")
    return out


def simulated_bubble(orders: list, fwd=1, bwd=2, message=0, between=0, durations: list | None = None) -> list:
    """Each stage's idle share of the replayed step (simulate's arguments): an exact Fraction on the ideal clock
    (whole slots), a float when a measured run is replayed (seconds)."""
    runs = simulate(orders, fwd, bwd, message, between, durations)
    span = max(e for r in runs for *_, e in r)
    busy = [sum(e - s for *_, s, e in r) for r in runs]
    if all(isinstance(v, int) for v in busy + [span]):
        return [1 - Fraction(b, span) for b in busy]
    return [1 - b / span for b in busy]
