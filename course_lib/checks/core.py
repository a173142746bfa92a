"""The checking machinery every exercise uses: run the learner's function and the reference on the same real ranks.

One launch per world size runs every case (tensor size, dtype) in turn: on every rank the reference (torch's own
op) first, then the learner's function on an identical input while switch_off.py keeps the forbidden collectives
off and watch.py records every message. The kernel then compares results, the input tensor itself when the
exercise works in place, and the traffic, and raises ExerciseFailed naming the case, the rank, what was expected,
what came back and a hint.
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch

from ..measure.c10d_ops import COLLECTIVES
from ..runtime.launch import run
from ..runtime.results import RankFailed, RankTimeout

# A check cell shows the learner's own frames only: the checker's source (its hint, its reference) is no help to
# read, and a highlighted line of it can give the answer away.
_LIBRARY = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_FRAME = re.compile(r'^\s*File "' + re.escape(_LIBRARY))
# The student copy's stub: raise NotImplementedError("Exercise 4.1: <title>: write your solution here")
_STUB = re.compile(r"^(Exercise \S+?):.*write your solution here")


def _learner_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without the entries of course_lib's own files, re-linked."""
    kept = []
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_LIBRARY):
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for entry in reversed(kept):
        out = types.TracebackType(out, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return out


def learner_view(exc: BaseException) -> list[str]:
    """What a notebook shows for a checker's error (IPython's ``_render_traceback_``): the learner's frames only."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return [f"{type(exc).__name__}: {exc}"]
    exc.__suppress_context__ = True      # a chained error's frames would be the checker's again
    return shell.InteractiveTB.structured_traceback(type(exc), exc, _learner_frames(exc.__traceback__))


_RULE_FIX = re.compile(r"(NCCL rule '[a-z0-9-]+' on rank \d+: .*?) Fix: [^\n]*")


def without_rule_fixes(text: str) -> str:
    """An NCCL rule's message keeps what broke and why, not its fix: in an exercise the fix is the answer."""
    return _RULE_FIX.sub(r"\1", text)


def without_library_frames(text: str) -> str:
    """A rank's traceback as text, without the frames (and their source lines) of course_lib's own files."""
    out, skip = [], False
    for line in text.split("\n"):
        if _LIBRARY_FRAME.match(line):
            skip = True
            continue
        if skip and line.startswith("    ") and not line.lstrip().startswith("File "):
            skip = False
            continue
        skip = False
        out.append(line)
    return "\n".join(out)


class ExerciseFailed(AssertionError):
    """The learner's function gave a wrong answer (or failed) on some case; the message says which and why."""

    def __init__(self, message: str = ""):
        super().__init__(without_rule_fixes(without_library_frames(str(message))))

    def _render_traceback_(self) -> list[str]:
        return learner_view(self)


class NotAttempted(NotImplementedError):
    """The learner's function still raises the student copy's NotImplementedError: said in one line."""

    def __init__(self, exercise: str):
        super().__init__(f"{exercise}: not attempted yet. Write your solution where the exercise's cell raises "
                         "NotImplementedError, run that cell, then this check again.")

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


def not_attempted(exercise: str, message: str = "") -> NotAttempted:
    """The one-line error for an exercise whose stub still raises (the id from the stub, else from ``exercise``)."""
    stub = _STUB.match(message)
    return NotAttempted(stub.group(1) if stub else exercise)


class CaseFailed(RuntimeError):
    """The learner's function raised on a rank; the message names the case."""


@dataclass(frozen=True)
class Case:
    world: int
    size: int
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"world_size={self.world}, size={self.size}, dtype={str(self.dtype).replace('torch.', '')}"


def _fmt(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.tolist()} ({str(t.dtype).replace('torch.', '')}, shape {tuple(t.shape)})"
    return repr(t)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        # float32 sums of the few values a check uses differ only by summation order: 1e-5 relative covers it
        close = a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)
        return a.dtype == b.dtype and close
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def with_hint(text: str, hint: str) -> str:
    return text + (f"\nHint: {hint}" if hint else "")


def passed(exercise: str, what: str) -> None:
    """The one pass line every checker prints (returns None: a returned string would show again as the cell's value)."""
    print(f"✓ {exercise} passed: {what}")


def explain(exercise: str, exc: RankFailed, what: str, hint: str) -> Exception:
    """The exception for a failed launch: not attempted, a switched-off call, a hang, a deadlock, or a failure."""
    f = exc.failure
    if f.etype in ("NotImplementedError", "NotAttempted"):     # a student copy: the exercise is not done yet
        return not_attempted(exercise, f.message)
    if f.etype == "SwitchedOff":
        return ExerciseFailed(with_hint(f"{f.message} (rank {f.rank}, {what})", hint))
    if isinstance(exc, RankTimeout):
        return ExerciseFailed(with_hint(f"{exercise}: your function did not finish in time (a deadlock?) with "
                                        f"{what}.\n\n{exc}", hint))
    if "would deadlock" in f.message:   # the NCCL rules found a cycle of waiting ranks
        return ExerciseFailed(with_hint(f"{exercise}: your function deadlocked: every rank waited for another, with "
                                        f"{what}.\n\n{exc}", hint))
    return ExerciseFailed(with_hint(f"{exercise}: your function failed with {what}.\n\n{exc}", hint))


def learner_rules(backend: str) -> bool | None:
    """Learner code runs under the NCCL rules (notebook 04, section 6) unless its exercise chose gloo on purpose."""
    return True if backend != "gloo" else None


def launch_checked(exercise: str, fn, world: int, args=(), kwargs=None, hint: str = "", timeout: float = 30.0,
                   what: str = "", backend: str = "auto") -> list:
    """run(fn) on ``world`` ranks for a checker: the values, or the failure explained (see explain)."""
    try:
        return run(fn, world, args=args, kwargs=kwargs, backend=backend, timeout=timeout, output="none",
                   nccl_rules=learner_rules(backend)).values
    except RankFailed as exc:
        raise explain(exercise, exc, what or f"{world} ranks", hint) from None


def call_learner(exercise: str, fn: Callable, *args, library=(), why: str = "", hint: str = ""):
    """In this process: ``fn(*args)`` with the library answers in ``library`` switched off (SwitchedOff becomes
    ExerciseFailed with the hint; the student copy's NotImplementedError becomes NotAttempted; any other error of
    the learner's code shows the learner's frames only)."""
    from .switch_off import SwitchedOff, switched_off

    __tracebackhide__ = True     # IPython leaves this frame out of a traceback that goes on into the learner's code
    try:
        with switched_off(exercise, why=why, library=library):
            return fn(*args)
    except SwitchedOff as exc:
        raise ExerciseFailed(with_hint(str(exc), hint)) from None
    except NotImplementedError as exc:
        raise not_attempted(exercise, str(exc)) from None
    except Exception as exc:
        exc._render_traceback_ = partial(learner_view, exc)   # the checkers' frames above it are no help
        raise


def watched_call(exercise: str, learner: Callable, args=(), forbid=(), why: str = "", library=()):
    """On a rank: ``learner(*args)`` with the forbidden collectives and library answers off and every message
    recorded; returns (what it returned, this rank's traffic record). Re-raises as CaseFailed with the case
    prepended when the learner's code raises (NotImplementedError and SwitchedOff pass through unchanged)."""
    from .switch_off import switched_off
    from .watch import Watch

    with switched_off(exercise, forbid, why, library), Watch() as log:
        got = learner(*args)
    return got, log.record()


def _cases(exercise, learner, reference, make_input, cases, forbid, why, library):
    """Runs on every rank: each case in turn, the reference first (a learner's bug must not disturb it)."""
    import torch.distributed as dist

    from course_lib.runtime.devices import device

    from .switch_off import SwitchedOff

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for case in cases:
        print(f"checking {case}", flush=True)     # the last line a rank printed names the case if it hangs
        want = reference(make_input(rank, world, case.size, case.dtype).to(device()))
        x = make_input(rank, world, case.size, case.dtype).to(device())
        try:
            got, record = watched_call(exercise, learner, (x,), forbid, why, library)
        except (NotImplementedError, SwitchedOff):
            raise
        except Exception as exc:
            raise CaseFailed(f"with {case}: {type(exc).__name__}: {exc}").with_traceback(exc.__traceback__) from None
        dist.barrier()        # the next case starts when every rank is done with this one
        out.append((want, got, x, record))
    return out


def check_collective(
    exercise: str,
    learner: Callable,
    reference: Callable,
    make_input: Callable,
    world_sizes: Iterable[int] = (2, 3, 4, 5),
    sizes: Iterable[int] = (1, 7, 12),
    dtypes: Iterable[torch.dtype] = (torch.float32, torch.int64),
    hint: str = "",
    timeout: float = 30.0,
    backend: str = "auto",
    forbid=(),
    why: str = "",
    library=(),
    traffic: Callable | None = None,
    in_place: bool = False,
) -> None:
    """Compare ``learner(x)`` with ``reference(x)`` on real ranks for every case (one launch per world size).

    ``make_input(rank, world_size, size, dtype)`` builds each rank's input; ``forbid``: collectives switched off
    (c10d_ops.COLLECTIVES names, or 'all'); ``library``: dotted paths switched off; ``in_place``: the input itself
    must hold the result; ``traffic(case, records)`` returns a message when the method is wrong. Raises
    ExerciseFailed on the first wrong case."""
    world_sizes, sizes, dtypes = list(world_sizes), list(sizes), list(dtypes)
    count = 0
    for world in world_sizes:
        cases = [Case(world, size, dtype) for size in sizes for dtype in dtypes]
        what = f"{world} ranks"
        try:
            res = run(_cases, world, args=(exercise, learner, reference, make_input, cases, forbid, why, library),
                      backend=backend, timeout=timeout, output="none", nccl_rules=learner_rules(backend))
        except RankFailed as exc:
            if exc.failure.etype == "CaseFailed":
                case = exc.failure.message.split(":", 1)[0].removeprefix("with ")
                how = ("did not finish in time (a deadlock?)" if "Timed out" in exc.failure.message
                       else "deadlocked: every rank waited for another" if "would deadlock" in exc.failure.message
                       else "failed")
                raise ExerciseFailed(with_hint(f"{exercise}: your function {how} with {case}.\n\n{exc}",
                                               hint)) from None
            raise explain(exercise, exc, what, hint) from None
        for i, case in enumerate(cases):
            per_rank = [v[i] for v in res.values]
            for rank, (want, got, x, _) in enumerate(per_rank):
                if in_place and not _same(want, x) and got is not None and _same(want, got):   # right, not in place
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: with {case}, rank {rank}'s tensor itself does not hold the result (it must "
                        f"work in place, like torch's own op).\n  expected: {_fmt(want)}\n  the tensor holds: "
                        f"{_fmt(x)}", hint))
                if in_place and not _same(want, x):                      # a wrong sum, whether returned or not
                    raise ExerciseFailed(with_hint(f"{exercise}: wrong result with {case} on rank {rank}.\n"
                                                   f"  expected: {_fmt(want)}\n  got:      {_fmt(x)}", hint))
                if not (in_place and got is None) and not _same(want, got):
                    raise ExerciseFailed(with_hint(f"{exercise}: wrong result with {case} on rank {rank}.\n"
                                                   f"  expected: {_fmt(want)}\n  got:      {_fmt(got)}", hint))
            if traffic is not None:
                wrong = traffic(case, [r for *_, r in per_rank])
                if wrong:
                    raise ExerciseFailed(with_hint(f"{exercise}: with {case}: {wrong}", hint))
            count += 1
    forbid = [forbid] if isinstance(forbid, str) else list(forbid)
    kept = [k for k in COLLECTIVES if k not in forbid]
    what_off = (f"every collective but {', '.join(kept)}" if forbid and len(kept) <= 2 else ", ".join(
        {"all": "every collective", "send_recv": "send/recv"}.get(f, f) for f in forbid))
    off = f" with {what_off} switched off" if forbid else ""
    method = ", and every rank's calls and messages were the method's" if traffic else ""
    return passed(exercise, f"{count} cases (world sizes {world_sizes}, sizes {sizes}, dtypes "
                            f"{[str(d).replace('torch.', '') for d in dtypes]}), every rank matched torch's own "
                            f"result{off}{method}.")
