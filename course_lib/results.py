"""What a launch brings back to the notebook: per-rank values, output and timings, or the one failure that matters."""

from __future__ import annotations

import html
import linecache
import signal
from dataclasses import dataclass, field

# Messages a rank prints when a *peer* died or stopped: consequences, never the cause (PITFALLS.md).
PEER_NOISE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "ECONNRESET",
    "EPIPE",
    "Socket closed",
    "closed by remote",
)


HINTS = (
    ("Detected mismatch between collectives",
     "The ranks called different collectives here (see 'differ in the following aspects'). Every rank must call "
     "the same collective, in the same order, with tensors of the same shape and dtype."),
    ("Timed out waiting",
     "This rank waited in a collective or recv for a peer that never came within the timeout. Look at the ranks "
     "still running: one of them did not call the matching operation."),
    ("Connection closed by peer",
     "Another rank's process ended while this one was talking to it: it crashed (its own error is the real "
     "cause), or it finished early because the ranks did not call the same collectives with the same sizes."),
)


def hint_for(message: str) -> str:
    """A sentence a learner can act on, for the torch.distributed errors learners meet most."""
    return next((hint for needle, hint in HINTS if needle in message), "")


def _code_objects(fn, seen=None):
    """Code objects the launcher sent by value: fn's own, nested ones, and __main__ functions it calls."""
    seen = set() if seen is None else seen
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen:
        return
    seen.add(id(code))
    stack = [code]
    while stack:
        c = stack.pop()
        yield c
        stack.extend(k for k in c.co_consts if hasattr(k, "co_lines"))
    glb = getattr(fn, "__globals__", {})
    for name in code.co_names:
        g = glb.get(name)
        if callable(g) and getattr(g, "__module__", None) == "__main__":
            yield from _code_objects(g, seen)


def resolve_frames(frames: list, fn) -> list:
    """Give back the file names that cloudpickle replaces with '<dynamic-code>', so cell lines can be shown."""
    if not any(f[0] == "<dynamic-code>" for f in frames):
        return frames
    by_name: dict[str, list] = {}
    for c in _code_objects(fn):
        lines = [ln for _, _, ln in c.co_lines() if ln is not None]
        by_name.setdefault(c.co_name, []).append((c.co_filename, min(lines, default=0), max(lines, default=0)))
    out = []
    for filename, lineno, name, line in frames:
        if filename == "<dynamic-code>":
            match = [f for f, lo, hi in by_name.get(name, []) if lo <= (lineno or 0) <= hi]
            filename = match[0] if match else filename
        out.append((filename, lineno, name, line))
    return out


@dataclass
class RankFailure:
    """How one rank failed: raised an exception, died from a signal, or exited without reporting."""

    rank: int
    kind: str  # "raised" | "signal" | "exit"
    message: str
    time: float
    etype: str = ""
    frames: list = field(default_factory=list)
    traceback: str = ""
    exitcode: int | None = None
    stderr_tail: str = ""
    phase: str = ""  # "load", "init" (joining the group), "fn" (the learner's code), "teardown" (waiting at the end)

    @property
    def consequence(self) -> bool:
        return self.kind == "raised" and any(p in self.message for p in PEER_NOISE)

    def headline(self) -> str:
        if self.kind == "raised":
            return f"rank {self.rank} raised {self.etype}: {self.message}".rstrip()
        if self.kind == "signal":
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            what = " (a crash inside C++ code: read its stderr below)" if name in ("SIGABRT", "SIGSEGV") else ""
            return f"rank {self.rank} was killed by {name} ({-self.exitcode}){what}"
        return f"rank {self.rank} {self.message}"

    def formatted_traceback(self) -> str:
        """The rank's traceback, with source lines of notebook cells filled in from this kernel's cache."""
        if not self.frames:
            return self.traceback
        lines = [f"Traceback of rank {self.rank} (most recent call last):"]
        for filename, lineno, name, line in self.frames:
            lines.append(f'  File "{filename}", line {lineno}, in {name}')
            line = line or linecache.getline(filename, lineno or 0).strip()
            if line:
                lines.append(f"    {line}")
        lines.append(f"{self.etype}: {self.message}")
        return "\n".join(lines)


class RankFailed(RuntimeError):
    """One rank failed; every other rank was stopped. ``.failure`` is the cause, ``.others`` what peers reported."""

    def __init__(self, failure: RankFailure, others: list[RankFailure], still_running: list[int]):
        self.failure, self.others, self.still_running = failure, others, still_running
        self.rank = failure.rank
        super().__init__(self._text())

    def _text(self) -> str:
        f = self.failure
        parts = [f.headline()]
        if self.still_running:
            parts.append(
                f"Ranks still running when it failed: {', '.join(map(str, self.still_running))} "
                "(they were stopped). A rank that never reaches the matching collective keeps its peers waiting."
            )
        if f.kind == "raised":
            parts.append(f.formatted_traceback())
            if hint_for(f.message):
                parts.append("Hint: " + hint_for(f.message))
        if f.stderr_tail:
            parts.append(f"Last lines rank {f.rank} wrote to stderr:\n{f.stderr_tail}")
        if self.others:
            said = "; ".join(f"rank {o.rank}: {o.etype or o.kind}: {o.message[:120]}" for o in self.others)
            parts.append(f"Other ranks then reported (consequences of the first failure): {said}")
        return "\n\n".join(parts)


class RankTimeout(RankFailed):
    """The launch ran past its timeout; names the ranks that had not finished."""

    def __init__(self, timeout: float, unfinished: list[int], finished: list[int], tails: dict[int, str]):
        self.timeout, self.unfinished, self.finished, self.tails = timeout, unfinished, finished, tails
        msg = (
            f"ranks {', '.join(map(str, unfinished))} had not finished after {timeout:g} s (timeout={timeout:g}); "
            f"finished: {', '.join(map(str, finished)) or 'none'}. They were stopped. Usual causes: a rank waits in "
            "send/recv or a collective that its peer never calls (check that every rank calls the same collectives "
            "in the same order), or the work needs more time (pass a larger timeout=)."
        )
        for r, tail in tails.items():
            if tail:
                msg += f"\n\nLast output of rank {r}:\n{tail}"
        failure = RankFailure(rank=unfinished[0], kind="timeout", message=msg, time=0.0)
        RuntimeError.__init__(self, msg)
        self.failure, self.others, self.still_running, self.rank = failure, [], unfinished, unfinished[0]


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
