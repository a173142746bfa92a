"""How one rank failed, told in sentences a learner can act on: which rank, what it was doing, what to look at.

gloo's messages start with its own source path and end with advice for its developers; a timeout inside a
collective is gloo's "Timed out waiting 3000ms for recv operation". Here the path goes, the meaning stays, a
timeout names the call that waited, and the ranks a hint refers to are named.
"""

from __future__ import annotations

import linecache
import re
import signal
from dataclasses import dataclass, field

# Messages a rank prints when a *peer* died or stopped: consequences, never the cause.
PEER_NOISE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "ECONNRESET",
    "EPIPE",
    "Socket closed",
    "closed by remote",
)
_SOURCE_PATH = re.compile(r"\[[^\[\]\s]*\.(?:cc|cpp|h|hpp|cu):\d+\]\s*")  # "[/__w/.../pair.cc:553] "
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation")


def clean(message: str) -> str:
    """A torch/gloo message without the C++ source paths it starts with."""
    return _SOURCE_PATH.sub("", message).strip()


def shorten(text: str, limit: int = 160) -> str:
    """The first sentences of ``text`` that fit in ``limit`` characters, cut at a word if one sentence is longer."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit]
    end = max(cut.rfind(". "), cut.rfind("! "), cut.rfind("? "))
    if end > limit // 3:
        return cut[: end + 1]
    return cut[: cut.rfind(" ")].rstrip(",;:") + " ..." if " " in cut else cut + "..."


def names(ranks) -> str:
    """'rank 3', 'ranks 2 and 3', 'ranks 0, 1 and 2'."""
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _in_torch(filename: str) -> bool:
    return "/torch/" in filename.replace("\\", "/")


def timed_out_call(frames: list) -> str:
    """The torch.distributed call a rank was waiting in, from its traceback: 'dist.recv', or the line itself."""
    calls = [name for filename, _, name, _ in frames if filename.endswith("distributed_c10d.py")]
    if calls:
        return f"dist.{calls[0]}"
    own = [line or linecache.getline(filename, lineno or 0) for filename, lineno, _, line in frames
           if not _in_torch(filename)]
    own = [line.strip() for line in own if line and line.strip()]
    return f"`{own[-1]}`" if own else "a collective or recv"


HINTS = (
    ("Detected mismatch between collectives",
     "The ranks called different collectives here (see 'differ in the following aspects'). Every rank must call "
     "the same collective, in the same order, with tensors of the same shape and dtype."),
    ("Timed out waiting",
     "This rank waited in a collective or recv for a peer that never came within the timeout. {look}"),
    ("Connection closed by peer",
     "Another rank's process ended while this one was talking to it: it crashed (its own error is the real "
     "cause), or it finished early because the ranks did not call the same collectives with the same sizes."),
)


def hint_for(message: str, running=(), returned=(), done: str = "returned from the function") -> str:
    """A sentence a learner can act on, for the torch.distributed errors learners meet most; a timeout's hint
    names the ranks that were still running or had already ``done`` (returned from the function, finished the
    cell)."""
    hint = next((hint for needle, hint in HINTS if needle in message), "")
    running, returned = list(running), list(returned)
    if running and returned:
        look = (f"Look at {names(running)} (still running) and {names(returned)} (already {done}): one of them "
                "did not call the matching operation.")
    elif len(running + returned) == 1:
        state = "was still running" if running else f"had already {done}"
        look = f"Look at {names(running + returned)}, which {state}: it did not call the matching operation."
    elif running or returned:
        state = "still running then" if running else f"already {done}"
        look = f"Look at {names(running + returned)}, {state}: one of them did not call the matching operation."
    else:
        look = "Look for the rank that did not call the matching operation."
    return hint.format(look=look)


@dataclass
class FailureRecord:
    """How one rank failed: raised an exception, died from a signal, or exited without reporting."""

    rank: int
    kind: str  # "raised" | "signal" | "exit" | "timeout"
    message: str  # the rank's own words, unchanged (str of its exception)
    time: float  # wall clock (time.time) of the failure, the same clock in a rank and in the kernel
    etype: str = ""
    frames: list = field(default_factory=list)
    traceback: str = ""
    exitcode: int | None = None
    stderr_tail: str = ""
    phase: str = ""  # "load", "init" (joining the group), "fn" (the learner's code), "teardown" (waiting at the end)

    @property
    def consequence(self) -> bool:
        """What a rank says when a peer died: never the cause of a launch's failure."""
        return self.kind == "raised" and any(p in self.message for p in PEER_NOISE)

    @property
    def timed_out(self) -> bool:
        """The rank waited in a collective or recv until the process group's timeout released it."""
        return self.kind == "raised" and _GLOO_TIMEOUT.search(self.message) is not None

    def headline(self) -> str:
        if self.timed_out:
            ms = int(_GLOO_TIMEOUT.search(self.message).group(1))
            return (f"rank {self.rank} timed out after {ms / 1000:g} s waiting in {timed_out_call(self.frames)}: "
                    f"the peer it waited for never completed the matching call (not reached, or called with another "
                    f"size) ({clean(self.message)})")
        if self.kind == "raised":
            return f"rank {self.rank} raised {self.etype}: {clean(self.message)}".rstrip()
        if self.kind == "signal":
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            what = ""
            if name in ("SIGABRT", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL"):
                what = (", a crash inside C++ code: its last lines on stderr are below" if self.stderr_tail else
                        ", a crash inside C++ code; it wrote nothing to stderr before it died")
            return f"rank {self.rank} was killed by {name} ({-self.exitcode}){what}"
        return f"rank {self.rank} {self.message}"

    def short(self) -> str:
        """One line for the list of what the other ranks reported."""
        what = f"{self.etype}: {clean(self.message)}" if self.kind == "raised" else self.headline()
        return f"rank {self.rank}: {shorten(what)}"

    def formatted_traceback(self) -> str:
        """The rank's traceback, with source lines of notebook cells filled in from this kernel's cache; the frames
        inside torch below the learner's last one are summed up in a line (all of them are in ``.traceback``)."""
        if not self.frames:
            return self.traceback
        # the NCCL-rules mode's own frames (its checks) teach nothing: the learner's call above them is the story
        frames = [f for f in self.frames if not f[0].endswith(("nccl_rules.py", "nccl_order.py", "nccl_host.py"))]
        own = [i for i, f in enumerate(frames) if not _in_torch(f[0])]
        keep = frames[: own[-1] + 1] if own else frames
        lines = [f"Traceback of rank {self.rank} (most recent call last):"]
        for filename, lineno, name, line in keep:
            lines.append(f'  File "{filename}", line {lineno}, in {name}')
            line = line or linecache.getline(filename, lineno or 0).strip()
            if line:
                lines.append(f"    {line}")
        inside = frames[len(keep):]
        if inside:
            lines.append(f"  ... then {len(inside)} frame{'s' if len(inside) > 1 else ''} inside torch, down to "
                         f"{inside[-1][2]}() in {inside[-1][0].replace(chr(92), '/').rsplit('/', 1)[-1]}")
        lines.append(f"{self.etype}: {clean(self.message)}")
        return "\n".join(lines)


def unpaired_calls(first: FailureRecord, ranks: list[int]) -> FailureRecord:
    """Every rank returned from the function, yet the launcher's closing barrier timed out: say that, not "late"."""
    waited = names([r for r in ranks if r != first.rank])
    return FailureRecord(first.rank, "exit", (
        f"returned from the function{f' as did {waited}' if waited else ''}, yet the launcher's closing barrier then "
        f"failed on rank {first.rank} ({shorten(clean(first.message))}): a collective of the function was paired on "
        "some rank with a different call "
        "(one rank calling more collectives than another, other sizes, another order), and the group was left "
        "waiting. check_collectives=True names a mismatch of sizes or order on every rank."), first.time,
        phase="teardown")


def first_of(failures: list[FailureRecord]) -> FailureRecord:
    """The failure that is the story: a cause before a consequence, the learner's code before the end-of-run wait,
    then the earliest."""
    return min(failures, key=lambda f: (f.consequence, f.phase == "teardown", f.time))


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
