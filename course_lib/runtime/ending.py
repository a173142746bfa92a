"""Ending the processes the course starts: SIGTERM to each process group, SIGKILL later, one routine for all.

TermThenKill is the only code in course_lib that signals a process to end it (docs/ARCHITECTURE.md, section 4):
run()'s ranks and persistent ranks step it from their own event loop; a torchrun node, a grading kernel and the
rank server are ended by end_tree, which runs the same escalation on runtime.loop over the process and all below.
"""

from __future__ import annotations

import os
import signal
import time

from .loop import Loop
from .protocol import KILL_WAIT_S, TERM_TO_KILL_S


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), read from /proc: it finds the ones in other sessions."""
    by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            by_parent.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting to be reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


class TermThenKill:
    """Ending processes still running: SIGTERM, SIGKILL ``term_s`` later, giving up KILL_WAIT_S after that.

    Each process is an object with ``pid`` and ``exit`` (None while running); ``stopped_by_us`` is set on it, so
    an exit by our own signal is not taken for a failure. The signal goes to the process group the process leads
    (what it started there) and to the process itself; never to the caller's own group.
    """

    def __init__(self, procs: list, term_s: float = TERM_TO_KILL_S):
        self.procs, self.term_s = procs, term_s
        self.phase = "running"  # -> "SIGTERM" -> "SIGKILL" -> "gave up"
        self.since = 0.0

    def _send(self, sig: int, phase: str, now: float) -> None:
        self.phase, self.since = phase, now
        own = os.getpgrp()
        for p in self.procs:
            if p.exit is None:
                p.stopped_by_us = True
                for kill in ((os.killpg, os.kill) if p.pid != own else (os.kill,)):
                    try:
                        kill(p.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass

    def terminate(self, now: float) -> None:
        self._send(signal.SIGTERM, "SIGTERM", now)

    def kill(self, now: float) -> None:
        self._send(signal.SIGKILL, "SIGKILL", now)

    def tick(self, now: float) -> None:
        """Move on when the current phase's time is up."""
        if self.phase == "SIGTERM" and now - self.since >= self.term_s:
            self.kill(now)
        elif self.phase == "SIGKILL" and now - self.since >= KILL_WAIT_S:
            self.phase = "gave up"

    def over(self) -> bool:
        """Every process has exited, or the escalation gave up on those that did not."""
        return self.phase == "gave up" or all(p.exit is not None for p in self.procs)


class _Pid:
    """A process known by its pid (or our own Popen of it): exited once it is gone, reaped or a zombie."""

    def __init__(self, pid: int, popen=None):
        self.pid, self.popen, self.exit, self.stopped_by_us = pid, popen, None, False

    def look(self) -> None:
        if self.exit is None:
            if self.popen is not None:  # our child: reap it (a zombie counts as alive where there is no /proc)
                self.exit = self.popen.poll()
            elif not alive(self.pid):
                self.exit = 0


def end_tree(pid, polite: bool = True, grace: float = 3.0) -> list[int]:
    """End ``pid`` (a pid or a Popen) and every process below it, whatever session each is in; returns survivors.

    ``polite``: SIGTERM first and up to ``grace`` seconds to go (torchrun ends its workers on SIGTERM), then
    SIGKILL to whatever is left, newcomers included. A torchrun worker runs in a session of its own (torch's
    SubprocessHandler), so a signal to torchrun's group alone would miss it: every process found is signalled.
    """
    popen = None if pid is None or isinstance(pid, int) else pid  # a subprocess.Popen we started
    if popen is not None:
        pid = popen.pid
    if pid is None or pid <= 0:
        return []
    procs = [_Pid(pid, popen), *(_Pid(p) for p in descendants(pid))]
    ending = TermThenKill(procs, term_s=grace)

    def tick(now: float) -> None:
        if ending.phase == "SIGTERM" and now - ending.since >= ending.term_s:
            # what started below the tree while it was asked to end goes too
            known = {p.pid for p in procs}
            procs.extend(_Pid(p) for p in descendants(pid) if p not in known)
        for p in procs:
            p.look()
        ending.tick(now)

    (ending.terminate if polite else ending.kill)(time.monotonic())
    Loop().run(ending.over, tick=tick)
    return [p.pid for p in procs if p.exit is None]
