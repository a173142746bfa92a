"""run(fn, world_size): start real torch.distributed ranks from a notebook cell and bring back what they return.

The runtime contract is in ../shared/DESIGN.md; notebooks/00_start_here.ipynb teaches it. This module knows
nothing about any lesson: it launches, streams each rank's output into the cell, and stops every rank as soon as
one fails, is interrupted, or runs out of time.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import sys
import tempfile
import time
from datetime import timedelta

from ._forkserver import get_server
from .devices import LaunchError, plan
from .rank_process import RankProcess, rank_env
from .results import RankFailed, RankFailure, RankTimeout, RunResult, resolve_frames

STOP_GRACE_S = 0.3  # after a first failure, how long peers may still report their own error before being stopped
TERM_TO_KILL_S = 1.0  # SIGTERM, then SIGKILL this much later (a rank blocked in C++ may ignore gentler signals)
# Joining the process group can fail for reasons outside the learner's code (on this build machine gloo's
# connectFullMesh was refused about once in a few hundred launches). Before the learner's function has started
# on any rank, starting again is safe; after that, never.
SETUP_ATTEMPTS = 3


class _Launch:
    def __init__(self, server, the_plan, fn_bytes: bytes, timeout: float, check_collectives: bool, init: bool,
                 output: str):
        self.server, self.plan, self.fn_bytes = server, the_plan, fn_bytes
        self.timeout, self.check, self.init, self.output = timeout, check_collectives, init, output
        self.fn = None  # set by run(): lets a traceback show the source lines of notebook cells
        self.ranks: list[RankProcess] = []
        self.failures: list[RankFailure] = []
        self.still_running_at_failure: list[int] = []

    # ------------------------------------------------------------ start
    def start(self, store_file: str, store_port: int | None) -> None:
        n = self.plan.world_size
        threads = max(1, (os.cpu_count() or 1) // n)
        for rank in range(n):
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            res_r, res_w = os.pipe()
            payload = {
                "rank": rank, "local_rank": rank, "world_size": n, "backend": self.plan.backend,
                "store_file": store_file, "timeout": self.timeout,
                "init": self.init, "threads": threads, "fn": self.fn_bytes,
                "env": rank_env(self.plan, rank, threads, self.check, store_port), "cwd": os.getcwd(),
                "sys_path": list(sys.path),
            }
            try:
                pid = self.server.spawn(payload, [out_w, err_w, res_w])
            except BaseException:
                for fd in (out_r, err_r, res_r):
                    os.close(fd)
                raise
            finally:
                for fd in (out_w, err_w, res_w):
                    os.close(fd)
            self.ranks.append(RankProcess(rank, pid, out_r, err_r, res_r))

    # ------------------------------------------------------------ watch
    def _emit(self, rp: RankProcess, kind: str, data: bytes, final: bool = False) -> None:
        buf = rp.partial[kind] + data
        *lines, rest = buf.split(b"\n")
        if final and rest:
            lines, rest = [*lines, rest], b""
        rp.partial[kind] = rest
        live = self.output == "live"
        stream = sys.stdout if kind == "out" else sys.stderr
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            rp.text[kind].append(line + "\n")
            if live:
                stream.write(f"[rank {rp.rank}] {line}\n")
        if lines and live:
            stream.flush()

    def print_grouped(self) -> None:
        """Each rank's output after the run, in rank order: deterministic, easier to read for short demos."""
        for rp in self.ranks:
            for kind, stream in (("out", sys.stdout), ("err", sys.stderr)):
                for line in rp.text[kind]:
                    stream.write(f"[rank {rp.rank}] {line}")
            sys.stdout.flush()
            sys.stderr.flush()

    def _read(self, sel, key) -> None:
        rp, kind = key.data
        try:
            data = os.read(key.fd, 65536)
        except BlockingIOError:
            return
        if data:
            if kind == "res":
                rp.res += data
            else:
                self._emit(rp, kind, data)
            return
        sel.unregister(key.fd)
        rp.open.discard(kind)
        if kind != "res":
            self._emit(rp, kind, b"", final=True)

    def _note_exits(self, now: float) -> None:
        for rp in self.ranks:
            if rp.exit is None and rp.pid in self.server.exits:
                rp.exit = self.server.exits.pop(rp.pid)
                rp.exit_seen = now

    def _judge(self, rp: RankProcess) -> RankFailure | None:
        res = rp.result()
        if res is not None and not res["ok"]:
            return RankFailure(rp.rank, "raised", res["message"], res["time"], etype=res["etype"],
                               frames=res.get("frames", []), traceback=res["traceback"],
                               stderr_tail=rp.tail("err"), phase=res.get("phase", ""))
        if rp.stopped_by_us and rp.exit in (-signal.SIGTERM, -signal.SIGKILL):
            return None  # we ended it; a SIGABRT or SIGSEGV that beat our signal still counts as a failure
        if rp.exit is not None and rp.exit < 0:
            return RankFailure(rp.rank, "signal", "", rp.exit_seen, exitcode=rp.exit, stderr_tail=rp.tail("err"))
        if rp.exit is not None and (rp.exit != 0 or res is None):
            why = f"exited with code {rp.exit}" + ("" if res else " without returning a result")
            return RankFailure(rp.rank, "exit", why, rp.exit_seen, exitcode=rp.exit, stderr_tail=rp.tail("err"))
        return None

    def _signal(self, sig: int) -> None:
        for rp in self.ranks:
            if rp.exit is None:
                rp.stopped_by_us = True
                for kill in (os.killpg, os.kill):
                    try:
                        kill(rp.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass

    def watch(self) -> None:
        sel = selectors.DefaultSelector()
        for rp in self.ranks:
            for kind, fd in rp.fds.items():
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ, (rp, kind))
        sel.register(self.server.fileno(), selectors.EVENT_READ, None)
        t0 = time.monotonic()
        deadline = t0 + self.timeout + 5.0  # the process-group timeout fires first and names the collective
        stop_at = kill_at = None
        judged: set[int] = set()
        try:
            while True:
                now = time.monotonic()
                if stop_at is None and now > deadline:
                    return self._timed_out()
                if stop_at is not None and now >= stop_at:
                    self._signal(signal.SIGTERM)
                    stop_at, kill_at = float("inf"), now + TERM_TO_KILL_S
                if kill_at is not None and now >= kill_at:
                    self._signal(signal.SIGKILL)
                    kill_at = float("inf")
                for key, _ in sel.select(timeout=0.05):
                    if key.data is None:
                        if not self.server.pump(0):
                            raise RuntimeError("the rank server died; run the cell again to restart it")
                    else:
                        self._read(sel, key)
                now = time.monotonic()
                self._note_exits(now)
                for rp in self.ranks:
                    if rp.rank in judged or not rp.done(now):
                        continue
                    judged.add(rp.rank)
                    failure = self._judge(rp)
                    if failure:
                        if not self.failures:
                            self.still_running_at_failure = [r.rank for r in self.ranks if r.exit is None]
                            stop_at = now + STOP_GRACE_S
                        self.failures.append(failure)
                if all(rp.done(now) for rp in self.ranks):
                    return None
        finally:
            sel.close()

    def _timed_out(self):
        finished = [rp.rank for rp in self.ranks if rp.exit is not None]
        unfinished = [rp.rank for rp in self.ranks if rp.exit is None]
        tails = {r: self.ranks[r].tail("out", 5) for r in unfinished}
        return RankTimeout(self.timeout, unfinished, finished, tails)

    # ------------------------------------------------------------ stop
    def stop(self) -> None:
        """End every rank still running, SIGTERM then SIGKILL, and wait until the server has reaped them."""
        if all(rp.exit is not None for rp in self.ranks):
            return
        steps = [(signal.SIGTERM, TERM_TO_KILL_S), (signal.SIGKILL, 5.0)]
        for sig, wait in steps:
            self._signal(sig)
            end = time.monotonic() + wait
            while time.monotonic() < end and any(rp.exit is None for rp in self.ranks):
                try:
                    self.server.pump(0.05)
                except KeyboardInterrupt:
                    break  # a second interrupt: go straight to SIGKILL
                self._note_exits(time.monotonic())
            if all(rp.exit is not None for rp in self.ranks):
                return

    def close(self) -> None:
        for rp in self.ranks:
            for fd in rp.fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass

    def setup_failed(self) -> bool:
        """Every failure happened while joining the process group, and no rank began the learner's function."""
        return bool(self.failures) and not any(rp.started for rp in self.ranks) and all(
            f.kind == "raised" and f.phase == "init" for f in self.failures)

    def outcome(self, wall: float) -> RunResult:
        if self.failures:
            first = min(self.failures, key=lambda f: (f.consequence, f.time))
            others = [f for f in self.failures if f is not first]
            if first.phase == "teardown":
                # A rank that finished waits for the others at the end; if that wait ran out, the ranks it waited
                # for are the story, not the waiting rank's timeout message.
                done = sorted(f.rank for f in self.failures if f.phase == "teardown")
                late = [r for r in self.still_running_at_failure if r not in done] or [first.rank]
                raise RankTimeout(self.timeout, late, done, {r: self.ranks[r].tail("out", 5) for r in late})
            for f in self.failures:
                f.frames = resolve_frames(f.frames, self.fn)
            raise RankFailed(first, others, [r for r in self.still_running_at_failure if r != first.rank])
        results = [rp.result() for rp in self.ranks]
        return RunResult(
            values=[r["value"] for r in results],
            stdout=["".join(rp.text["out"]) for rp in self.ranks],
            stderr=["".join(rp.text["err"]) for rp in self.ranks],
            times=[r["times"] for r in results],
            memory=[r.get("memory", {}) for r in results],
            backend=self.plan.backend,
            devices=self.plan.devices,
            wall_s=wall,
        )


def run(fn, world_size: int = 4, *, args=(), kwargs=None, backend: str = "auto", timeout: float = 60.0,
        check_collectives: bool = False, init: bool = True, output: str = "live") -> RunResult:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return a RunResult (notebooks/00_start_here.ipynb).

    ``init=True`` initialises the default process group first (gloo on CPU or NCCL on ``cuda:rank``) and destroys
    it after. ``check_collectives=True`` is the teaching mode: TORCH_DISTRIBUTED_DEBUG=DETAIL makes a collective
    whose op, shape or dtype differ across ranks fail on every rank instead of hanging or returning garbage.
    ``timeout`` bounds every collective and the whole launch, in seconds. ``output``: "live" streams every
    rank's lines into the cell as they come (interleaved, as ranks really run), "grouped" prints them after the
    run in rank order, "none" only keeps them in the result.
    """
    if not callable(fn):
        raise LaunchError(f"run() needs a function to run on every rank; got {type(fn).__name__} {fn!r}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise LaunchError(f"timeout must be a positive number of seconds, like 30; got {timeout!r}.")
    if output not in ("live", "grouped", "none"):
        raise LaunchError(f"output must be 'live', 'grouped' or 'none'; got {output!r}.")
    the_plan = plan(backend, world_size)
    import cloudpickle

    try:
        fn_bytes = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        raise LaunchError(
            f"Could not send {getattr(fn, '__name__', 'the function')} and its arguments to the ranks ({exc}). "
            "Pass data the ranks can receive (tensors, numbers, lists), and open files or sockets inside the function."
        ) from None

    for attempt in range(1, SETUP_ATTEMPTS + 1):
        launch, timed_out, wall = _attempt(fn, fn_bytes, the_plan, float(timeout), check_collectives, init, output)
        if timed_out is not None:
            raise timed_out
        if attempt < SETUP_ATTEMPTS and launch.setup_failed():
            first = launch.failures[0]
            print(f"[course_lib] process-group setup failed on rank {first.rank} before your function started "
                  f"({first.message.splitlines()[0][:100]}); starting the ranks again (attempt {attempt + 1} "
                  f"of {SETUP_ATTEMPTS})", file=sys.stderr)
            continue
        return launch.outcome(wall)


def _attempt(fn, fn_bytes, the_plan, timeout, check_collectives, init, output):
    """One launch: start every rank, watch until all are done or one fails, stop the rest."""
    import torch.distributed as dist

    server = get_server()
    with server.lock:
        launch = _Launch(server, the_plan, fn_bytes, timeout, check_collectives, init, output)
        launch.fn = fn
        # The launcher's own rendezvous is a file in a private temporary folder: no port to collide with another
        # kernel or student, and none of the 5 s client-connect stalls we measured with TCPStore on this build
        # machine (about one connect in 25). env:// (init=False) gets a TCPStore hosted here on a port the OS picks.
        rdzv = tempfile.mkdtemp(prefix="course_lib-rdzv-")
        store = None
        if not init:
            store = dist.TCPStore("127.0.0.1", 0, the_plan.world_size, True, timedelta(seconds=timeout),
                                  wait_for_workers=False)
        t0 = time.perf_counter()
        try:
            launch.start(os.path.join(rdzv, "store"), store.port if store else None)
            timed_out = launch.watch()
        finally:
            launch.stop()
            launch.close()
            del store
            shutil.rmtree(rdzv, ignore_errors=True)
        if output == "grouped" and not (launch.setup_failed() and timed_out is None):
            launch.print_grouped()
        return launch, timed_out, time.perf_counter() - t0
