"""run(fn, world_size): start real torch.distributed ranks from a notebook cell and bring back what they return.

This module knows no lesson: it launches, streams each rank's output into the cell, and stops every rank as soon
as one fails, is interrupted, or runs out of time. notebooks/00_start_here.ipynb teaches it; docs/ARCHITECTURE.md
draws it. One launch moves through these phases (the watch loop below is written in them):

    running        every rank works; their lines are printed as they come, each rank judged when it ends
      | a rank failed (raised, was killed, exited without a result): the FIRST FAILURE, remembered
      v
    grace          STOP_GRACE_S for the others to report their own errors (the teaching mode raises on all)
      |                                             running past timeout + WATCH_SLACK_S also leads here:
      v                                                 v
    SIGTERM        every unfinished rank's process group is asked to stop
      | TERM_TO_KILL_S
      v
    SIGKILL        what is left is killed (a rank blocked in C++ ignores gentler signals)
      v
    drained        every rank has exited and its pipes are read to the end: the launch returns or raises

Ctrl-C (the kernel's stop button) in any phase: SIGTERM, then SIGKILL, wait until every rank is reaped, then
KeyboardInterrupt reaches the cell.
"""

from __future__ import annotations

import inspect
import os
import shutil
import sys
import tempfile
import time
from functools import partial

from .devices import plan
from .ending import TermThenKill
from .forkserver import get_server, start_early
from .loop import Loop
from .machine_limits import check_platform, check_world_size
from .nccl_rules import wanted
from .protocol import DRAIN_S, SETUP_ATTEMPTS, STOP_GRACE_S, WATCH_SLACK_S
from .rank_failure import FailureRecord, first_of, resolve_frames, unpaired_calls
from .rank_process import RankProcess, end_ranks, library_modules, payload, rank_preloads, spawn
from .results import LaunchError, RankFailed, RankTimeout, RunResult
from .stacks import dump, hang_report, main_frames

RUNNING, GRACE, SIGTERM, SIGKILL, DRAINED = "running", "grace", "SIGTERM", "SIGKILL", "drained"


class _Launch:
    """One launch: its ranks, what each reported, and the phase it is in."""

    def __init__(self, server, the_plan, timeout: float, output: str):
        self.server, self.plan, self.timeout, self.output = server, the_plan, timeout, output
        self.ranks: list[RankProcess] = []
        self.failures: list[FailureRecord] = []
        self.running_at_failure: list[int] = []
        self.unfinished_at_deadline: list[int] | None = None
        self.phase = RUNNING
        self.wall = 0.0
        self.stack_files: dict[int, str] = {}   # rank -> the file its stack is dumped into (runtime/stacks.py)
        self.folder = ""                        # the launch's private folder: rendezvous, stacks, flight records
        self.stacks: dict[int, list] = {}       # rank -> its main thread's frames, dumped while it still ran

    def watch(self) -> None:
        """Read output and results and move through the phases until every rank is drained."""
        loop = Loop()
        for rp in self.ranks:
            for kind, fd in rp.fds.items():
                loop.watch(fd, partial(self._read, rp, kind))
        loop.watch(self.server.fileno(), self._pump)
        self._deadline = time.monotonic() + self.timeout + WATCH_SLACK_S
        self._ending, self._grace_end, self._judged = TermThenKill(self.ranks), 0.0, set()
        loop.run(lambda: self.phase == DRAINED, tick=self._tick)

    def _tick(self, now: float) -> None:
        """Judge the ranks that ended, then move on one phase if its condition holds (the table in the docstring)."""
        for rp in self.ranks:
            rp.note_exit(self.server.exits, now)
            if rp.rank not in self._judged and rp.done(now, DRAIN_S):
                self._judged.add(rp.rank)
                self._judge(rp)
        if len(self._judged) == len(self.ranks):
            self.phase = DRAINED
        elif self.phase == RUNNING and self.failures:  # the first failure
            if any(f.timed_out for f in self.failures):  # a hang: where are the ranks still running?
                self._locate([rp for rp in self.ranks if rp.exit is None])
            self.phase, self._grace_end = GRACE, time.monotonic() + STOP_GRACE_S
        elif self.phase == RUNNING and now > self._deadline:
            self.unfinished_at_deadline = [rp.rank for rp in self.ranks if rp.exit is None]
            self._locate([rp for rp in self.ranks if rp.exit is None])
            self.phase = SIGTERM
            self._ending.terminate(time.monotonic())
        elif self.phase == GRACE and now >= self._grace_end:
            self.phase = SIGTERM
            self._ending.terminate(now)
        elif self.phase in (SIGTERM, SIGKILL):
            self._ending.tick(now)
            self.phase = DRAINED if self._ending.phase == "gave up" else self._ending.phase

    def _pump(self) -> bool:
        """The server reports pids and exit codes."""
        if not self.server.pump(0):
            raise RuntimeError("the rank server died; run the cell again to restart it")
        return True

    def _read(self, rp: RankProcess, kind: str) -> bool:
        """What a rank's pipe holds now, printed as it comes with output="live"; False once the pipe is at its end."""
        lines = rp.read(kind)
        if lines and self.output == "live":
            stream = sys.stdout if kind == "out" else sys.stderr
            stream.write("".join(f"[rank {rp.rank}] {line}" for line in lines))
            stream.flush()
        return kind in rp.open

    def _locate(self, procs: list[RankProcess]) -> None:
        """Ask the ranks still running for their stacks (a hang): where each one waits goes into the report."""
        if procs and self.stack_files:
            texts = dump({rp.rank: rp.pid for rp in procs}, self.stack_files)
            self.stacks.update({r: main_frames(t) for r, t in texts.items() if main_frames(t)})

    def where(self, fn) -> str:
        """One line per place the ranks were when the launch hung (stacks.hang_report)."""
        return hang_report(self.failures, self.stacks, self.folder, fn)

    def _judge(self, rp: RankProcess) -> None:
        """Record how a finished rank failed, if it did; the first failure remembers who was still running."""
        res = rp.result()
        # the wall clock of the exit, as a rank's own report carries one (time.time): first_of compares them
        exited = time.time() - (time.monotonic() - rp.exit_seen)
        if res is not None and not res["ok"]:
            failure = FailureRecord(rp.rank, "raised", res["message"], res["time"], etype=res["etype"],
                                  frames=res.get("frames", []), traceback=res["traceback"],
                                  stderr_tail=rp.tail("err"), phase=res.get("phase", ""))
        elif rp.stopped_by_us and rp.exit in (-15, -9):  # SIGTERM, SIGKILL: we ended it, it did not fail
            return
        elif rp.exit is not None and rp.exit < 0:  # a SIGABRT or SIGSEGV, even one that beat our signal
            failure = FailureRecord(rp.rank, "signal", "", exited, exitcode=rp.exit, stderr_tail=rp.tail("err"))
        elif rp.exit != 0 or res is None:
            why = f"exited with code {rp.exit}" + ("" if res else " without returning a result")
            failure = FailureRecord(rp.rank, "exit", why, exited, exitcode=rp.exit, stderr_tail=rp.tail("err"))
        else:
            return
        if not self.failures:
            self.running_at_failure = [r.rank for r in self.ranks if r.exit is None]
        self.failures.append(failure)

    def setup_failed(self) -> bool:
        """Every failure happened while joining the process group, and no rank began the learner's function."""
        return bool(self.failures) and not any(rp.started for rp in self.ranks) and all(
            f.kind == "raised" and f.phase == "init" for f in self.failures)

    def print_grouped(self) -> None:
        """Each rank's output after the run, in rank order: deterministic, easier to read for short demos."""
        for rp in self.ranks:
            for kind, stream in (("out", sys.stdout), ("err", sys.stderr)):
                stream.write("".join(f"[rank {rp.rank}] {line}" for line in rp.text[kind]))
                stream.flush()

    def result(self, fn) -> RunResult:
        """What the ranks returned, or raise the failure that is the story (RankTimeout, RankFailed)."""
        tails = lambda ranks: {r: self.ranks[r].tail("out", 5) for r in ranks}  # noqa: E731
        if self.unfinished_at_deadline is not None:
            late = self.unfinished_at_deadline
            raise RankTimeout(self.timeout, late, [r for r in range(len(self.ranks)) if r not in late], tails(late),
                              self.where(fn), self.wall)
        if self.failures:
            first = first_of(self.failures)
            if first.phase == "teardown":
                # Every failure is a rank that finished and waited for the others at the end, until the timeout:
                # the ranks it waited for are the story, not the waiting rank's timeout message.
                done = sorted(f.rank for f in self.failures)
                returned = {rp.rank for rp in self.ranks if (rp.result() or {}).get("ok")}   # ended well, later
                late = [r for r in self.running_at_failure if r not in done and r not in returned]
                if late:
                    raise RankTimeout(self.timeout, late, done, tails(late), self.where(fn), self.wall)
                raise RankFailed(unpaired_calls(first, sorted({*done, *returned})), [], [])
            hung = self.where(fn) if (self.stacks or any(f.timed_out for f in self.failures)) else ""
            for f in self.failures:
                f.frames = resolve_frames(f.frames, fn)
            raise RankFailed(first, [f for f in self.failures if f is not first],
                             [r for r in self.running_at_failure if r != first.rank], hung)
        results = [rp.result() for rp in self.ranks]
        return RunResult(values=[r["value"] for r in results], stdout=["".join(rp.text["out"]) for rp in self.ranks],
                         stderr=["".join(rp.text["err"]) for rp in self.ranks], times=[r["times"] for r in results],
                         memory=[r.get("memory", {}) for r in results], backend=self.plan.backend,
                         devices=self.plan.devices, wall_s=self.wall)


def _check_call(fn, args, kwargs) -> None:
    """Refuse, before launching, a function that cannot be called the way every rank will call it."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or an odd callable: let the rank say what went wrong
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__name__", "fn")
        given = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        raise LaunchError(
            f"run() calls {name}({given[:60]}) on every rank, with no rank or world size added, and {name}{sig} "
            f"cannot be called that way ({exc}): ask dist.get_rank() and dist.get_world_size() inside the function, "
            "and pass other inputs with args= or kwargs=."
        ) from None


def run(fn, world_size: int = 4, *, args=(), kwargs=None, backend: str = "auto", timeout: float = 60.0,
        check_collectives: bool = False, init: bool = True, output: str = "live",
        oversubscribe: bool = False, nccl_rules: bool | None = None) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return a RunResult (notebooks/00_start_here.ipynb).

    ``init=True`` joins the default process group first (gloo on CPU or NCCL on ``cuda:rank``) and destroys it
    after; with ``init=False`` the function calls ``dist.init_process_group`` itself (env://, as under torchrun,
    or its own MASTER_PORT or tcp:// address). ``check_collectives=True`` is the teaching mode:
    TORCH_DISTRIBUTED_DEBUG=DETAIL makes a collective whose op, shape or dtype differ across ranks fail on every
    rank instead of hanging or returning garbage. ``timeout`` bounds every collective and the whole launch, in
    seconds. ``output``: "live" streams every rank's lines into the cell as they come, "grouped" prints them after
    the run in rank order, "none" only keeps them in the result. A world size beyond this machine's memory or
    file descriptors is refused unless ``oversubscribe=True``. ``nccl_rules=True`` (or COURSE_NCCL_RULES=1 for
    every launch that did not choose backend="gloo") makes gloo ranks fail where NCCL would (nccl_rules.py).

    The first rank to fail ends the launch: the others are stopped and RankFailed names that rank with its
    traceback. Past the timeout, RankTimeout names the ranks that had not finished. Interrupting the cell (Ctrl-C,
    the stop button) stops every rank, SIGTERM then SIGKILL, waits until none is left, and raises
    KeyboardInterrupt.
    """
    __tracebackhide__ = True  # pytest and IPython: the launcher's frames teach nothing
    if not callable(fn):
        raise LaunchError(f"run() needs a function to run on every rank; got {type(fn).__name__} {fn!r}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise LaunchError(f"timeout must be a positive number of seconds, like 30; got {timeout!r}.")
    if output not in ("live", "grouped", "none"):
        raise LaunchError(f"output must be 'live', 'grouped' or 'none'; got {output!r}.")
    _check_call(fn, tuple(args), dict(kwargs or {}))
    check_platform()
    the_plan = plan(backend, world_size)
    check_world_size(the_plan.world_size, oversubscribe)
    import cloudpickle

    try:
        fn_bytes = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        raise LaunchError(
            f"Could not send {getattr(fn, '__name__', 'the function')} and its arguments to the ranks ({exc}). "
            "Pass data the ranks can receive (tensors, numbers, lists), and open files or sockets inside the function."
        ) from None

    preload = library_modules(fn, tuple(args), dict(kwargs or {}))
    for attempt in range(1, SETUP_ATTEMPTS + 1):
        launch = _launch_once(the_plan, fn_bytes, float(timeout), check_collectives, init, output,
                              wanted(nccl_rules, backend, the_plan.backend), preload)
        if attempt < SETUP_ATTEMPTS and launch.setup_failed():
            first = launch.failures[0]
            print(f"[course_lib] process-group setup failed on rank {first.rank} before your function started "
                  f"({first.message.splitlines()[0][:100]}); starting the ranks again (attempt {attempt + 1} "
                  f"of {SETUP_ATTEMPTS})", file=sys.stderr)
            continue
        if output == "grouped":
            launch.print_grouped()
        try:
            return launch.result(fn)
        except RankFailed as err:
            raise err.with_traceback(None) from None


def _launch_once(the_plan, fn_bytes, timeout, check_collectives, init, output, rules=False, preload=()) -> _Launch:
    """Start every rank, watch them through the phases, and make sure none is left, whatever happens."""
    server = get_server((*rank_preloads(), "course_lib.runtime.rank_main", *preload))
    # The rendezvous is a FileStore in a private temporary folder: no port to collide with another kernel or
    # student, and none of the 5 s client-connect stalls we measured with TCPStore (about one connect in 25).
    rdzv = tempfile.mkdtemp(prefix="course_lib-rdzv-")
    with server.lock:
        launch = _Launch(server, the_plan, timeout, output)
        launch.folder = rdzv
        t0 = time.perf_counter()
        try:
            for rank in range(the_plan.world_size):
                launch.stack_files[rank] = os.path.join(rdzv, f"stack-{rank}")
                launch.ranks.append(spawn(server, payload(
                    the_plan, rank, timeout=timeout, check_collectives=check_collectives,
                    store_file=os.path.join(rdzv, "store"), entry="course_lib.runtime.rank_main", fn=fn_bytes,
                    init=init, nccl_rules=rules, stack_file=launch.stack_files[rank])))
            launch.watch()
        finally:
            try:
                end_ranks(launch.ranks, server)  # nothing to do after a normal end; after Ctrl-C or an error, the rest
            finally:  # a second Ctrl-C while ranks are ended still closes the pipes and removes the folder
                for rp in launch.ranks:
                    rp.close()
                shutil.rmtree(rdzv, ignore_errors=True)
        launch.wall = time.perf_counter() - t0
    return launch


start_early(("course_lib.runtime.rank_main",))
