"""What a launch brings back to the notebook: per-rank values, output and timings, or the one failure that matters."""

from __future__ import annotations

import html
from dataclasses import dataclass

from .rank_failure import FailureRecord, hint_for, names

__all__ = ["LaunchError", "RankFailed", "FailureRecord", "RankTimeout", "RunResult"]


class LaunchError(ValueError):
    """A launch request that cannot work; raised before any rank process starts."""


class RankFailed(RuntimeError):
    """One rank failed; every other rank was stopped. ``.failure`` is the cause, ``.others`` what peers reported."""

    def __init__(self, failure: FailureRecord, others: list[FailureRecord], still_running: list[int], where: str = ""):
        self.failure, self.others, self.still_running = failure, others, still_running
        self.rank, self.where = failure.rank, where  # where: each rank's line, after a timeout (runtime/stacks.py)
        super().__init__(self._text())

    done = "returned from the function"  # what a rank that is no longer part of the run had done

    def returned(self) -> list[int]:
        """Ranks that had finished the function and waited at the end (so did not call what the others waited in)."""
        return sorted(o.rank for o in self.others if o.phase == "teardown")

    def situation(self, running: list[int], returned: list[int]) -> list[str]:
        """What the other ranks were doing when the first failed."""
        out = []
        if running:
            were = "was" if len(running) == 1 else "were"
            # a broken NCCL rule is its own story; the waiting-peer sentence is for timeouts and exceptions
            ruled = self.failure.etype == "NcclRuleBroken" or "NcclRuleBroken: " in self.failure.message
            why = "" if ruled else (
                " A rank that never reaches the matching collective keeps its peers waiting.")
            out.append(f"{names(running).capitalize()} {were} still running when it failed (stopped since).{why}")
        if returned:
            out.append(f"{names(returned).capitalize()} had returned from the function and waited for the others "
                       "at the end, until the timeout.")
        return out

    def _text(self) -> str:
        f = self.failure
        returned = self.returned()
        running = [r for r in self.still_running if r not in returned]
        parts = [f.headline(), *self.situation(running, returned)]
        if f.kind == "raised":
            parts.append(f.formatted_traceback())
            hint = hint_for(f.message, running, returned, self.done)
            if hint:
                parts.append("Hint: " + hint)
        if self.where:
            parts.append(self.where)
        if f.stderr_tail:
            parts.append(f"Last lines rank {f.rank} wrote to stderr:\n{f.stderr_tail}")
        said = [o.short() for o in self.others if o.phase != "teardown"]
        if said:
            parts.append("Other ranks then reported (consequences of the first failure):\n  " + "\n  ".join(said))
        return "\n\n".join(parts)

    def _render_traceback_(self):
        """What IPython shows: this message alone, not the launcher's frames above it (the rank's own are in it)."""
        return f"{type(self).__name__}: {self}".split("\n")


class RankTimeout(RankFailed):
    """The launch ran past its timeout; names the ranks that had not finished."""

    def __init__(self, timeout: float, unfinished: list[int], finished: list[int], tails: dict[int, str],
                 where: str = "", elapsed: float | None = None):
        self.timeout, self.unfinished, self.finished, self.tails = timeout, unfinished, finished, tails
        had = "It was" if len(unfinished) == 1 else "They were"
        ended = f"{names(finished)} had" if finished else "no rank had"
        after = timeout if elapsed is None else elapsed
        msg = (
            f"{names(unfinished)} had not finished after {after:.3g} s (timeout={timeout:g}); {ended}. {had} "
            "stopped. Usual causes: a rank waits in send/recv or a collective that its peer never calls (check that "
            "every rank calls the same collectives in the same order), or the work needs more time (pass a larger "
            "timeout=)."
        )
        if where:
            msg += "\n\n" + where
        for r, tail in tails.items():
            if tail:
                msg += f"\n\nLast output of rank {r}:\n{tail}"
        failure = FailureRecord(rank=unfinished[0], kind="timeout", message=msg, time=0.0)
        RuntimeError.__init__(self, msg)
        self.failure, self.others, self.still_running, self.rank = failure, [], unfinished, unfinished[0]
        self.where = where


def _short(value, limit: int = 80) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class RunResult:
    """Everything one launch brought back: ``values[r]`` is what rank r's function returned."""

    values: list
    stdout: list[str]
    stderr: list[str]
    times: list[dict]
    memory: list[dict]
    backend: str
    devices: tuple[str, ...]
    wall_s: float

    @property
    def world_size(self) -> int:
        return len(self.values)

    def __getitem__(self, rank: int):
        return self.values[rank]

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self):
        return iter(self.values)

    def _rows(self):
        for r in range(self.world_size):
            t = self.times[r]
            yield r, self.devices[r], _short(self.values[r]), 1e3 * t.get("fn_s", 0.0), self.stdout[r].count("\n")

    def __repr__(self) -> str:
        head = f"RunResult: {self.world_size} ranks, backend={self.backend}, {self.wall_s:.2f} s wall"
        rows = [f"  rank {r} [{d}] -> {v}  ({ms:.1f} ms in fn)" for r, d, v, ms, _ in self._rows()]
        return "\n".join([head, *rows])

    def _repr_html_(self) -> str:
        cells = "".join(
            f"<tr><td>{r}</td><td>{html.escape(d)}</td><td><code>{html.escape(v)}</code></td>"
            f"<td>{ms:.1f}</td><td>{n}</td></tr>"
            for r, d, v, ms, n in self._rows()
        )
        return (
            f"<p><b>{self.world_size} ranks</b>, backend <code>{self.backend}</code>, {self.wall_s:.2f} s wall</p>"
            "<table><tr><th>rank</th><th>device</th><th>returned</th><th>ms in fn</th><th>lines printed</th></tr>"
            f"{cells}</table>"
        )
