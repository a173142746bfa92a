"""A persistent group of ranks that keeps each rank's variables between cells (notebooks/05b_collectives_cell_by_cell).

Built on the course's rank server rather than ipyparallel: its engines each import torch when they start, and an
engine blocked in a C++ recv could not be interrupted; here a group starts with a fork per rank, and the stop
button restarts a group that is stuck (``python -m course_lib bench interactive`` measures start and round trip).
The pieces: rank_process.py (a rank's life cycle), rank_channel.py (requests and replies),
cell_result.py (what a cell brought back), restart_policy.py (what a failure does to the group).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time

from . import transfer
from .cell_result import CellResult, CellTimeout, assemble
from .devices import plan
from .forkserver import get_server
from .machine_limits import check_platform, check_world_size
from .nccl_rules import wanted
from .protocol import ASK_EXIT_S, CELL_SLACK_S, CELL_TIMEOUT_S, INTERRUPT_GRACE_S, SETUP_ATTEMPTS
from .rank_channel import Channel, ok
from .rank_process import end_ranks, payload, rank_preloads, spawn
from .restart_policy import after_cell, after_interrupt, refusal, still_running
from .stacks import cell_place, dump, main_frames, report

_live: list[Ranks] = []  # every started group, stopped at interpreter exit (kernel shutdown)


class Ranks:
    """A persistent group of ``world_size`` ranks; each keeps its variables between cells (``run_cell``)."""

    def __init__(self, world_size: int = 4, backend: str = "auto", timeout: float = 30.0,
                 check_collectives: bool = False, oversubscribe: bool = False, nccl_rules: bool | None = None,
                 cell_timeout: float = CELL_TIMEOUT_S):
        check_platform()
        self.plan = plan(backend, world_size)  # refuses an impossible request before any process starts
        check_world_size(self.plan.world_size, oversubscribe)
        self.timeout, self.check = float(timeout), check_collectives
        self.cell_timeout = float(cell_timeout)  # every cell's deadline, unless run_cell is given another
        self.stack_files: dict[int, str] = {}
        self.nccl_rules = wanted(nccl_rules, backend, self.plan.backend)
        self.channel: Channel | None = None
        self.broken = ""  # why the group cannot run cells any more ("" while it can)
        self._rdzv = None
        self.start_s = 0.0

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def procs(self) -> list:
        return self.channel.procs if self.channel else []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> Ranks:
        """Fork the ranks from the rank server and wait until every one has joined the process group."""
        self.stop()
        t0 = time.perf_counter()
        for attempt in range(1, SETUP_ATTEMPTS + 1):
            self._spawn()
            self.channel.wait(self.procs, None, time.monotonic() + self.timeout + CELL_SLACK_S)
            failed = [p for p in self.procs if not (p.reply and p.reply[0] == "ready")]
            if not failed:
                break
            why = "; ".join(f"rank {p.rank}: " + (p.reply[1] if p.reply else "did not start") for p in failed)
            self.stop()
            if attempt == SETUP_ATTEMPTS:
                raise RuntimeError(f"the ranks could not join the process group: {why}")
            print(f"[course_lib] process-group setup failed ({why[:120]}); starting again", file=sys.stderr)
        self.broken = ""
        self.start_s = time.perf_counter() - t0
        if self not in _live:
            _live.append(self)
        return self

    def _spawn(self) -> None:
        server = get_server((*rank_preloads(), "course_lib.runtime.persistent_rank_main"))
        self._rdzv = tempfile.mkdtemp(prefix="course_lib-ranks-")
        self.channel = Channel(server, [])
        with server.lock:
            for rank in range(self.world_size):
                self.stack_files[rank] = os.path.join(self._rdzv, f"stack-{rank}")
                the_payload = payload(self.plan, rank, timeout=self.timeout, check_collectives=self.check,
                                      store_file=os.path.join(self._rdzv, "store"),
                                      entry="course_lib.runtime.persistent_rank_main", nccl_rules=self.nccl_rules,
                                      stack_file=self.stack_files[rank])
                the_payload["env"]["MPLBACKEND"] = "Agg"  # ranks draw headless; their figures come back as PNGs
                self.channel.procs.append(spawn(server, the_payload, persistent=True))

    def stop(self) -> None:
        """End every rank (asked to exit, then SIGTERM, then SIGKILL) and wait until each one is reaped."""
        channel, self.channel = self.channel, None
        if self in _live:
            _live.remove(self)
        try:
            if channel is not None and channel.server.alive():
                channel.ask_exit(ASK_EXIT_S)
                end_ranks(channel.procs, channel.server)
        finally:  # a second Ctrl-C while the ranks are ended still closes the pipes and removes the folder
            for p in channel.procs if channel is not None else []:
                p.close()
            if self._rdzv:
                shutil.rmtree(self._rdzv, ignore_errors=True)
                self._rdzv = None

    def restart(self) -> Ranks:
        """A fresh group (new processes, empty namespaces): the way out of a broken or out-of-step group."""
        return self.start()

    def __enter__(self) -> Ranks:
        return self.start() if not self.procs else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        ended = self.channel.ended() if self.procs and not self.broken else []
        if ended:   # a process that ended between cells: the next cell is reported as that rank's failure
            state = "broken: " + ", ".join(f"rank {p.rank}'s process has ended (exit code {p.exit})" for p in ended)
        else:
            state = "stopped" if not self.procs else (f"broken: {self.broken}" if self.broken else "ready")
        return f"Ranks({self.world_size} ranks, backend={self.plan.backend}, timeout={self.timeout:g} s, {state})"

    def _select(self, ranks) -> list:
        if not self.procs:
            raise RuntimeError("the ranks are not running: start them with Ranks(...).start() or %ranks start 4")
        if self.broken:
            raise RuntimeError(refusal(self.broken))
        if ranks is None:
            return list(self.procs)
        ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.world_size)]
        if bad or not ranks:
            raise ValueError(f"ranks must be numbers 0..{self.world_size - 1}; got {ranks!r}")
        return [self.procs[r] for r in sorted(set(ranks))]

    def run_cell(self, code: str, ranks=None, show: bool = True, timeout: float | None = None) -> CellResult:
        """Run ``code`` on every rank (or on ``ranks``), keeping each rank's variables; raise CellFailed on error,
        CellTimeout (saying where each rank was) past ``timeout`` seconds (default: the group's cell_timeout)."""
        procs = self._select(ranks)
        self.channel.drain()  # what a rank wrote between cells (C++ warnings) belongs to this cell's output
        t0 = time.perf_counter()
        seq = self.channel.send(procs, ("cell", code))
        limit = self.cell_timeout if timeout is None else float(timeout)
        deadline, failed, running = [time.monotonic() + limit], [False], []

        def first_failure(p):
            if not failed[0]:
                failed[0] = True
                deadline[0] = min(deadline[0], time.monotonic() + self.timeout + CELL_SLACK_S)
                running[:] = [q.rank for q in procs if q.reply is None]
                if running and show:
                    print(still_running(p.rank, running, self.timeout), file=sys.stderr, flush=True)

        try:
            self.channel.wait(procs, seq, lambda: deadline[0], first_failure)
        except KeyboardInterrupt:
            self._interrupt(procs, seq, show)
        if not failed[0] and any(p.reply is None for p in procs):
            self._past_deadline(procs, seq, code, limit, show)
        stuck = [p.rank for p in procs if p.reply is None]
        result = assemble(self.procs, procs, time.perf_counter() - t0)
        if show:
            result.show()
        verdict = after_cell(result.failures, stuck, self.timeout, CELL_SLACK_S, self.plan.backend, result.finished)
        if verdict.restart:
            self.restart()
        self.broken = verdict.broken or self.broken
        error = result.error(running, verdict.note)
        if error is not None:
            raise error
        return result

    def _past_deadline(self, procs, seq, code: str, limit: float, show: bool) -> None:
        """The cell ran past its deadline: say where each busy rank is, interrupt them, restart if one is stuck."""
        busy = [p for p in procs if p.reply is None]
        texts = dump({p.rank: p.pid for p in busy}, self.stack_files)
        places = {r: cell_place(main_frames(t), code) for r, t in texts.items()}
        self.channel.interrupt(busy)  # as the stop button: a rank in Python stops and keeps its variables
        try:
            self.channel.wait(busy, seq, time.monotonic() + INTERRUPT_GRACE_S)
        except KeyboardInterrupt:
            pass
        stuck = [p.rank for p in busy if p.reply is None]
        result = assemble(self.procs, procs, limit)
        if show:
            result.show()
        if stuck:  # blocked in C++ (a collective or recv): only new processes get the group back
            self.restart()
        raise CellTimeout(limit, [p.rank for p in busy], [r for r in result.finished], report(places),
                          restarted=bool(stuck))

    def _interrupt(self, procs, seq, show) -> None:
        """The stop button: relay SIGINT to every busy rank; restart the group if one stays blocked in C++."""
        pending = [p for p in procs if p.reply is None]
        self.channel.interrupt(pending)
        try:
            self.channel.wait(pending, seq, time.monotonic() + INTERRUPT_GRACE_S)
        except KeyboardInterrupt:  # pressed again: do not wait for the grace
            pass
        verdict = after_interrupt([p.rank for p in pending if p.reply is None], [p.rank for p in pending])
        result = assemble(self.procs, procs, 0.0)
        if show:
            result.show()
        if verdict.restart:
            self.restart()
        print(f"[course_lib] {verdict.note}", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    def pull(self, name: str, ranks=None) -> list:
        """The value of variable ``name`` on each rank (rank order; tensors come back on the CPU)."""
        procs = self._select(ranks)
        seq = self.channel.send(procs, ("pull", name))
        self.channel.wait(procs, seq, time.monotonic() + self.timeout)
        out = []
        for p in procs:
            if p.reply is None or p.reply[0] != "reply":
                raise RuntimeError(f"rank {p.rank} did not answer (is a cell still running there?)")
            if not ok(p.reply):
                raise KeyError(p.reply[2]["message"])
            out.append(transfer.loads(p.reply[2]["value"]))
        return out


@atexit.register
def _stop_all() -> None:
    # Kernel shutdown: no rank outlives its notebook (the rank server's lifeline is the second line of defence).
    for group in list(_live):
        try:
            group.stop()
        except Exception:
            pass
