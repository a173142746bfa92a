"""Persistent interactive ranks and the %%ranks magic: run notebook cells on every rank, cell by cell.

Taught in notebooks/05b_collectives_cell_by_cell.ipynb. Built on the course's rank fork server rather than
ipyparallel (REFERENCE.md, last section: ipyparallel took 9.7 s to be ready, 166 MB per rank, and its engine stayed
dead after an interrupt in a C++ recv); ``python -m course_lib bench interactive`` measures this module.
"""

from __future__ import annotations

import atexit
import os
import pickle
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time

from ._forkserver import get_server, recv_msg, send_msg
from .devices import plan
from .launch import SETUP_ATTEMPTS
from .rank_process import rank_env
from .results import RankFailed, RankFailure

INTERRUPT_GRACE_S = 2.0  # after relaying a stop press: a rank still busy now is blocked in C++ (a collective)
TERM_TO_KILL_S = 1.0
_live: list[Ranks] = []  # every started group, stopped at interpreter exit (kernel shutdown)


class CellFailed(RankFailed):
    """A cell failed on at least one rank: names the first failing rank and shows its traceback."""

    def __init__(self, failure, others, note: str = ""):
        self.note = note
        super().__init__(failure, others, [])

    def _text(self) -> str:
        return super()._text() + (f"\n\n{self.note}" if self.note else "")

    def _render_traceback_(self):  # IPython shows this instead of the kernel-side stack, which teaches nothing
        return str(self).split("\n")


_FAILURE_CLASSES: dict[str, type] = {}


def _failure_class(etype: str) -> type:
    """A CellFailed subclass named after the rank's exception, so the cell shows e.g. ``ValueError``."""
    if not etype.isidentifier():
        return CellFailed
    if etype not in _FAILURE_CLASSES:
        _FAILURE_CLASSES[etype] = type(etype, (CellFailed,), {"__module__": __name__})
    return _FAILURE_CLASSES[etype]


class CellResult:
    """What one cell did on each rank it ran on: output lines, last expression's repr, figures (PNG), errors."""

    def __init__(self, ranks):
        self.ranks = list(ranks)
        self.stdout = {r: "" for r in ranks}
        self.stderr = {r: "" for r in ranks}
        self.values: dict[int, str] = {}
        self.figures: dict[int, list[bytes]] = {r: [] for r in ranks}
        self.failures: list[RankFailure] = []
        self.seconds = 0.0

    def show(self) -> None:
        """Every rank's output in rank order, each line tagged with its rank (what the cell magic prints)."""
        for r in sorted(set(self.stdout) | set(self.stderr)):
            for kind, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                for line in getattr(self, kind).get(r, "").splitlines():
                    stream.write(f"[rank {r}] {line}\n")
            if r in self.values:
                sys.stdout.write(f"[rank {r}] Out: " + self.values[r].replace("\n", "\n" + " " * 14) + "\n")
            sys.stdout.flush()
            sys.stderr.flush()
            for png in self.figures.get(r, []):
                _display_png(png, r)


def _display_png(png: bytes, rank: int) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:
        return
    if get_ipython() is not None:
        display(Image(data=png, format="png"), metadata={"rank": rank})


class _Proc:
    """The kernel's view of one persistent rank: pid, control socket, stdout/stderr pipes, last reply."""

    def __init__(self, rank, pid, ctl, out_r, err_r):
        self.rank, self.pid, self.ctl = rank, pid, ctl
        self.pipes = {out_r: "out", err_r: "err"}
        self.partial = {"out": b"", "err": b""}
        self.text = {"out": [], "err": []}
        self.reply = None  # (kind, ...) of the request being waited for
        self.exit: int | None = None

    def take_text(self, kind: str) -> str:
        if self.partial[kind]:
            self.text[kind].append(self.partial[kind].decode("utf-8", "replace") + "\n")
            self.partial[kind] = b""
        text, self.text[kind] = "".join(self.text[kind]), []
        return text


class Ranks:
    """A persistent group of ``world_size`` ranks; each keeps its variables between cells (``run_cell``)."""

    def __init__(self, world_size: int = 4, backend: str = "auto", timeout: float = 30.0,
                 check_collectives: bool = False):
        self.plan = plan(backend, world_size)  # refuses an impossible request before any process starts
        self.timeout, self.check = float(timeout), check_collectives
        self.procs: list[_Proc] = []
        self.broken = ""  # why the group cannot run cells any more ("" while it can)
        self._seq = 0
        self._rdzv = None
        self.start_s = 0.0

    # ------------------------------------------------------------ life cycle
    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _payload(self, rank: int, store_file: str) -> dict:
        n = self.world_size
        threads = max(1, (os.cpu_count() or 1) // n)
        env = rank_env(self.plan, rank, threads, self.check)
        env["MPLBACKEND"] = "Agg"  # ranks draw headless; their figures come back as PNGs
        return {"entry": "course_lib._interactive_rank", "rank": rank, "local_rank": rank, "world_size": n,
                "backend": self.plan.backend, "device": self.plan.devices[rank], "store_file": store_file,
                "timeout": self.timeout, "threads": threads, "env": env, "cwd": os.getcwd(),
                "sys_path": list(sys.path)}

    def start(self) -> Ranks:
        """Fork the ranks from the rank server and wait until every one has joined the process group."""
        if self.procs:
            self.stop()
        t0 = time.perf_counter()
        for attempt in range(1, SETUP_ATTEMPTS + 1):
            self._spawn()
            self._wait(self.procs, None, time.monotonic() + self.timeout + 10.0)
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
        server = get_server()
        self._rdzv = tempfile.mkdtemp(prefix="course_lib-ranks-")
        with server.lock:
            for rank in range(self.world_size):
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    pid = server.spawn(self._payload(rank, os.path.join(self._rdzv, "store")),
                                       [out_w, err_w, theirs.fileno()])
                except BaseException:
                    for fd in (out_r, err_r):
                        os.close(fd)
                    ours.close()
                    raise
                finally:
                    os.close(out_w)
                    os.close(err_w)
                    theirs.close()
                for fd in (out_r, err_r):
                    os.set_blocking(fd, False)
                self.procs.append(_Proc(rank, pid, ours, out_r, err_r))

    def stop(self) -> None:
        """End every rank (asked to exit, then SIGTERM, then SIGKILL) and wait until each one is reaped."""
        procs, self.procs = self.procs, []
        if self in _live:
            _live.remove(self)
        server = get_server() if procs else None
        for p in procs:
            try:
                send_msg(p.ctl, ("exit", 0))
            except OSError:
                pass
        for sig, wait in ((None, 1.0), (signal.SIGTERM, TERM_TO_KILL_S), (signal.SIGKILL, 5.0)):
            pending = [p for p in procs if p.exit is None]
            for p in pending if sig else []:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(p.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            end = time.monotonic() + wait
            while pending and time.monotonic() < end and server.alive():
                with server.lock:
                    server.pump(0.02)
                for p in pending:
                    if p.pid in server.exits:
                        p.exit = server.exits.pop(p.pid)
                pending = [p for p in pending if p.exit is None]
            if not pending:
                break
        for p in procs:
            p.ctl.close()
            for fd in p.pipes:
                os.close(fd)
        if self._rdzv:
            shutil.rmtree(self._rdzv, ignore_errors=True)
            self._rdzv = None

    def restart(self) -> Ranks:
        """A fresh group (new processes, empty namespaces): the way out of a broken or out-of-step group."""
        self.stop()
        return self.start()

    def __enter__(self) -> Ranks:
        return self.start() if not self.procs else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if not self.procs else (f"broken: {self.broken}" if self.broken else "ready")
        return f"Ranks({self.world_size} ranks, backend={self.plan.backend}, timeout={self.timeout:g} s, {state})"

    # ------------------------------------------------------------ talking to the ranks
    def _read_pipe(self, p: _Proc, fd: int) -> None:
        kind = p.pipes[fd]
        while True:
            try:
                data = os.read(fd, 65536)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            *lines, p.partial[kind] = (p.partial[kind] + data).split(b"\n")
            p.text[kind].extend(line.decode("utf-8", "replace") + "\n" for line in lines)

    def _wait(self, procs, seq, deadline, on_failure=None) -> None:
        """Read output and replies until every rank in ``procs`` answered request ``seq`` or died, or deadline."""
        for p in procs:
            p.reply = None
        sel = selectors.DefaultSelector()
        for p in self.procs:
            for fd in p.pipes:
                sel.register(fd, selectors.EVENT_READ, (p, fd))
            if p in procs:
                sel.register(p.ctl, selectors.EVENT_READ, (p, None))
        try:
            while any(p.reply is None for p in procs):
                limit = deadline() if callable(deadline) else deadline
                if limit is not None and time.monotonic() > limit:
                    return
                for key, _ in sel.select(timeout=0.1):
                    p, fd = key.data
                    if fd is not None:
                        self._read_pipe(p, fd)
                        continue
                    try:
                        msg, _ = recv_msg(p.ctl)
                    except OSError:
                        msg = None
                    if msg is None:  # the rank died: its exit code comes from the server
                        sel.unregister(p.ctl)
                        p.reply = ("died", self._exit_code(p))
                    elif msg[0] in ("ready", "failed") or msg[1] == seq:
                        p.reply = msg
                    if p.reply and on_failure and not self._ok(p.reply):
                        on_failure(p)
        finally:
            sel.close()
        for p in self.procs:  # a rank flushes before it replies: its last lines are in the pipe already
            for fd in p.pipes:
                self._read_pipe(p, fd)

    def _exit_code(self, p: _Proc) -> int | None:
        server = get_server()
        end = time.monotonic() + 1.0
        with server.lock:
            while p.pid not in server.exits and time.monotonic() < end and server.pump(0.05):
                pass
        p.exit = server.exits.pop(p.pid, None)
        return p.exit

    @staticmethod
    def _ok(reply) -> bool:
        return reply[0] == "reply" and reply[2].get("ok", False)

    def _select(self, ranks) -> list[_Proc]:
        if not self.procs:
            raise RuntimeError("the ranks are not running: start them with Ranks(...).start() or %ranks start 4")
        if self.broken:
            raise RuntimeError(f"the group cannot run cells ({self.broken}); restart it with .restart() or "
                               "%ranks restart (every rank's variables are lost)")
        if ranks is None:
            return list(self.procs)
        ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.world_size)]
        if bad or not ranks:
            raise ValueError(f"ranks must be numbers 0..{self.world_size - 1}; got {ranks!r}")
        return [self.procs[r] for r in sorted(set(ranks))]

    def _send_all(self, procs, request) -> int:
        self._seq += 1
        for p in procs:
            send_msg(p.ctl, (*request, self._seq))
        return self._seq

    def run_cell(self, code: str, ranks=None, show: bool = True) -> CellResult:
        """Run ``code`` on every rank (or on ``ranks``), keeping each rank's variables; raise CellFailed on error."""
        procs = self._select(ranks)
        for p in self.procs:  # whatever a rank wrote between cells (C++ warnings) belongs to this cell's output
            for fd in p.pipes:
                self._read_pipe(p, fd)
        t0 = time.perf_counter()
        seq = self._send_all(procs, ("cell", code))
        deadline = [None]

        def first_failure(p):
            if deadline[0] is None:
                deadline[0] = time.monotonic() + self.timeout + 10.0
                waiting = [q.rank for q in procs if q.reply is None]
                if waiting and show:
                    verb = "is" if len(waiting) == 1 else "are"
                    print(f"[course_lib] rank {p.rank} failed; {_names(waiting)} {verb} still running. If they "
                          f"wait for rank {p.rank} in a collective, the {self.timeout:g} s timeout releases them "
                          "(or press stop to restart the group now).", file=sys.stderr, flush=True)

        try:
            self._wait(procs, seq, lambda: deadline[0], first_failure)
        except KeyboardInterrupt:
            self._interrupt(procs, seq, show)
        stuck = [p.rank for p in procs if p.reply is None]
        result = self._result(procs, time.perf_counter() - t0)
        if show:
            result.show()
        if stuck:
            self.restart()
            note = (f"{_names(stuck).capitalize()} stayed blocked {self.timeout + 10:g} s after the first failure, so "
                    "the group was restarted: new processes, every rank's variables are gone.")
        elif any(f.kind != "raised" for f in result.failures):
            self.broken = "a rank's process died"
            note = "A rank's process died, so the group cannot go on: %ranks restart (or .restart()) starts a new one."
        elif any(f.etype != "KeyboardInterrupt" and ("Timed out" in f.message or f.consequence)
                 for f in result.failures):
            # Measured with gloo: after a timeout it closes the pairs ("Application timeout caused pair closure"),
            # every later collective fails, and the tensor of a rank that timed out may hold a partial sum.
            note = ("A rank gave up waiting in a collective: its tensor may hold a partial result, and gloo closes its "
                    "connections after a timeout, so this group's collectives will fail from now on. Run %ranks "
                    "restart (or .restart()) for a fresh group; every rank's variables are lost.")
        else:
            note = "The other ranks' variables are kept; fix the cell and run it again."
        if result.failures:
            first = min(result.failures, key=lambda f: (f.consequence, f.time))
            raise _failure_class(first.etype)(first, [f for f in result.failures if f is not first], note)
        return result

    def _interrupt(self, procs, seq, show) -> None:
        """The stop button: relay SIGINT to every busy rank; restart the group if one stays blocked in C++."""
        pending = [p for p in procs if p.reply is None]
        for p in pending:
            try:
                os.kill(p.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        try:
            self._wait(pending, seq, time.monotonic() + INTERRUPT_GRACE_S)
        except KeyboardInterrupt:  # pressed again: do not wait for the grace
            pass
        stuck = [p.rank for p in pending if p.reply is None]
        result = self._result(procs, 0.0)
        if show:
            result.show()
        if stuck:
            self.restart()
            print(f"[course_lib] {_names(stuck)} stayed blocked inside C++ (a collective or recv waiting for a "
                  "peer), so the group was restarted: new processes, every rank's variables are "
                  "gone.", file=sys.stderr, flush=True)
        else:
            print(f"[course_lib] interrupted {_names([p.rank for p in pending])}; every rank keeps its "
                  "variables.", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    def _result(self, procs, seconds) -> CellResult:
        result = CellResult([p.rank for p in procs])
        result.seconds = seconds
        for p in self.procs:
            out, err = p.take_text("out"), p.take_text("err")
            if p in procs or out or err:
                result.stdout[p.rank], result.stderr[p.rank] = out, err
        for p in procs:
            tail = "\n".join(result.stderr.get(p.rank, "").rstrip("\n").split("\n")[-12:])
            if p.reply is None:
                continue
            if p.reply[0] == "died":
                code = p.reply[1]
                kind = "signal" if code is not None and code < 0 else "exit"
                result.failures.append(RankFailure(p.rank, kind, f"exited with code {code} (its process is gone)",
                                                   time.time(), exitcode=code, stderr_tail=tail))
                continue
            d = p.reply[2]
            result.figures[p.rank] = d.get("figures", [])
            if d["ok"]:
                if "value" in d:
                    result.values[p.rank] = d["value"]
            else:
                result.failures.append(RankFailure(p.rank, "raised", d["message"], d["time"], etype=d["etype"],
                                                   frames=d["frames"], traceback=d["traceback"], phase="fn"))
        return result

    def pull(self, name: str, ranks=None) -> list:
        """The value of variable ``name`` on each rank (rank order; tensors come back on the CPU)."""
        procs = self._select(ranks)
        seq = self._send_all(procs, ("pull", name))
        self._wait(procs, seq, time.monotonic() + self.timeout)
        out = []
        for p in procs:
            if p.reply is None or p.reply[0] != "reply":
                raise RuntimeError(f"rank {p.rank} did not answer (is a cell still running there?)")
            if not p.reply[2]["ok"]:
                raise KeyError(p.reply[2]["message"])
            out.append(pickle.loads(p.reply[2]["value"]))
        return out


def _names(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


@atexit.register
def _stop_all() -> None:
    # Kernel shutdown: no rank outlives its notebook (the rank server's lifeline is the second line of defence).
    for group in list(_live):
        try:
            group.stop()
        except Exception:
            pass


def current() -> Ranks | None:
    """The group that %ranks started (None before %ranks start); the magic lives in ranks_magic.py."""
    from .ranks_magic import current as started

    return started()


def load_ipython_extension(ipython) -> None:
    """%load_ext course_lib.interactive registers %ranks / %%ranks (course_lib/ranks_magic.py)."""
    from .ranks_magic import ranks_magic

    ipython.register_magic_function(ranks_magic, "line_cell", "ranks")
