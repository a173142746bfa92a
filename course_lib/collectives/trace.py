"""Step traces of the course's collectives: who sent which chunk to whom, and every rank's buffer after each step.

Taught in notebooks/06_build_your_own_collectives.ipynb and drawn by course_lib.viz.steps. Tracing costs nothing
when off: the algorithms take ``trace=None`` and test it once per step. Each rank records its own view; the
caller collects the ranks' traces (run(...).values) and merges them into global steps with `merge`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Trace:
    """One rank's record of one collective: chunk bounds, then one entry per step (phase, sends, buffer)."""

    algorithm: str = ""
    rank: int = 0
    world_size: int = 1
    chunks: list = field(default_factory=list)   # [(lo, hi)] element ranges of the flat buffer
    steps: list = field(default_factory=list)    # [{"phase", "sends": [(src, dst, chunk, nbytes)], "buffer"}]

    def begin(self, algorithm: str, rank: int, world_size: int, chunks, buffer: torch.Tensor) -> None:
        """Start (or continue, when one algorithm is made of two) a record with the rank's starting buffer."""
        if not self.steps:
            self.algorithm, self.rank, self.world_size, self.chunks = algorithm, rank, world_size, list(chunks)
            self.record("start", [], buffer)
        else:
            self.algorithm = f"{self.algorithm}+{algorithm}" if algorithm not in self.algorithm else self.algorithm

    def record(self, phase: str, sends, buffer: torch.Tensor) -> None:
        self.steps.append({"phase": phase, "sends": list(sends), "buffer": buffer.detach().to("cpu").clone()})


def merge(traces: list[Trace]) -> list[dict]:
    """Global steps from every rank's trace: {"phase", "sends": all ranks' sends, "buffers": [rank 0, 1, ...]}."""
    traces = sorted(traces, key=lambda t: t.rank)
    counts = {len(t.steps) for t in traces}
    if len(counts) != 1:
        raise ValueError(f"ranks recorded different numbers of steps: {[len(t.steps) for t in traces]}")
    out = []
    for i in range(counts.pop()):
        out.append({"phase": traces[0].steps[i]["phase"],
                    "sends": [s for t in traces for s in t.steps[i]["sends"]],
                    "buffers": [t.steps[i]["buffer"] for t in traces]})
    return out
