"""Talking to persistent ranks: numbered requests over each rank's control socket, their replies, their output.

The transport of persistent_ranks.py; the rank's side is persistent_rank_main.py and the
messages are listed in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import os
import signal
import time
from functools import partial

from .loop import Loop
from .protocol import recv_msg, send_msg
from .rank_process import RankProcess


class Channel:
    """Requests to a group of persistent ranks and the replies that answer them, reading output meanwhile."""

    def __init__(self, server, procs: list[RankProcess]):
        self.server, self.procs = server, procs
        self._seq = 0

    def drain(self) -> None:
        """Read what every rank's pipes hold now (a rank flushes before it replies)."""
        for p in self.procs:
            for kind in ("out", "err"):
                if kind in p.open:
                    p.read(kind)

    def send(self, procs: list[RankProcess], request: tuple) -> int:
        """Send ``request`` to each of ``procs``; returns its number, which their replies carry."""
        self._seq += 1
        for p in procs:
            try:
                send_msg(p.ctl, (*request, self._seq))
            except (BrokenPipeError, ConnectionResetError):
                pass  # it died since the last cell: wait() reads the EOF and reports how it ended
        return self._seq

    def ended(self) -> list[RankProcess]:
        """The ranks whose process has ended since the last request (NCCL's watchdog, a kill), as the server says."""
        with self.server.lock:
            self.server.pump(0)
        now = time.monotonic()
        for p in self.procs:
            p.note_exit(self.server.exits, now)
        return [p for p in self.procs if p.exit is not None]

    def wait(self, procs: list[RankProcess], seq: int | None, deadline, on_failure=None) -> None:
        """Read output and replies until each of ``procs`` answered ``seq`` (or died), or ``deadline`` passed.

        ``deadline``: a monotonic time, None for no limit, or a function giving either (it may change while
        waiting). ``on_failure(p)`` is called when a reply says the request failed on p.
        """
        for p in procs:
            p.reply = None
        loop = Loop()
        for p in self.procs:
            for kind in ("out", "err"):
                if kind in p.open:
                    loop.watch(p.fds[kind], partial(self._read, p, kind))
            if p in procs:
                loop.watch(p.ctl, partial(self._answer, p, seq, on_failure))
        try:
            loop.run(lambda: all(p.reply is not None for p in procs),
                     deadline if callable(deadline) else (lambda: deadline))
        finally:
            self.drain()

    @staticmethod
    def _read(p: RankProcess, kind: str) -> bool:
        p.read(kind)
        return kind in p.open

    def _answer(self, p: RankProcess, seq: int | None, on_failure) -> bool:
        """A message on p's control socket: the reply to ``seq`` (or the rank's first word), or EOF: it died."""
        try:
            msg, _ = recv_msg(p.ctl)
        except OSError:
            msg = None
        if msg is None:  # the rank died: its exit code comes from the server
            p.reply = ("died", self.exit_code(p))
        elif msg[0] in ("ready", "failed") or msg[1] == seq:
            p.reply = msg
        if p.reply and on_failure and not ok(p.reply):
            on_failure(p)
        return msg is not None

    def exit_code(self, p: RankProcess, within: float = 1.0) -> int | None:
        """The exit code the server reports for ``p`` (None if it did not within ``within`` seconds)."""
        self._await_server(lambda: p.pid in self.server.exits, within)
        p.note_exit(self.server.exits, time.monotonic())
        return p.exit

    def _await_server(self, done, within: float) -> None:
        """Read the server's reports (pids' exits) until ``done()`` or ``within`` seconds have passed."""
        end = time.monotonic() + within
        with self.server.lock:
            loop = Loop()
            loop.watch(self.server.fileno(), lambda: self.server.pump(0))
            loop.run(lambda: done() or not self.server.alive(), lambda: end)

    def interrupt(self, procs: list[RankProcess]) -> None:
        """Relay the stop button: SIGINT to each rank, which raises KeyboardInterrupt in a running cell."""
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def ask_exit(self, within: float) -> None:
        """Ask every rank to leave its loop, and wait up to ``within`` seconds for the server to report them gone."""
        for p in self.procs:
            try:
                send_msg(p.ctl, ("exit", 0))
            except OSError:
                pass

        def gone() -> bool:
            for p in self.procs:
                p.note_exit(self.server.exits, time.monotonic())
            return all(p.exit is not None for p in self.procs)

        self._await_server(gone, within)


def ok(reply) -> bool:
    """The reply says the request succeeded."""
    return reply[0] == "reply" and reply[2].get("ok", False)
