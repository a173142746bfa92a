"""Ending the processes the course starts: SIGTERM to a process group, SIGKILL later, and what a process left.

The one way every part of the course stops processes (docs/ARCHITECTURE.md, section 4): run()'s ranks and
persistent ranks through Escalation, a torchrun node and a grading kernel through end_tree.
"""

from __future__ import annotations

import os
import signal
import time

from ..protocol import KILL_WAIT_S, TERM_TO_KILL_S


def signal_group(pid: int, sig: int) -> None:
    """``sig`` to the process group ``pid`` leads (what it started there), then to ``pid`` itself."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


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


class Escalation:
    """Ending processes still running: SIGTERM, SIGKILL TERM_TO_KILL_S later, giving up KILL_WAIT_S after.

    Each process is an object with ``pid`` and ``exit`` (None while running); ``stopped_by_us`` is set on it, so
    an exit by our own signal is not taken for a failure.
    """

    def __init__(self, procs: list):
        self.procs = procs
        self.phase = "running"  # -> "SIGTERM" -> "SIGKILL" -> "gave up"
        self.since = 0.0

    def _send(self, sig: int, phase: str, now: float) -> None:
        self.phase, self.since = phase, now
        for p in self.procs:
            if p.exit is None:
                p.stopped_by_us = True
                signal_group(p.pid, sig)

    def terminate(self, now: float) -> None:
        self._send(signal.SIGTERM, "SIGTERM", now)

    def kill(self, now: float) -> None:
        self._send(signal.SIGKILL, "SIGKILL", now)

    def tick(self, now: float) -> None:
        """Move on when the current phase's time is up."""
        if self.phase == "SIGTERM" and now - self.since >= TERM_TO_KILL_S:
            self.kill(now)
        elif self.phase == "SIGKILL" and now - self.since >= KILL_WAIT_S:
            self.phase = "gave up"


def end_tree(pid: int | None, polite: bool = True, grace: float = 3.0) -> list[int]:
    """End ``pid`` and every process below it, whatever session each is in; returns the pids that survived.

    ``polite``: SIGTERM first and up to ``grace`` seconds to go (torchrun ends its workers on SIGTERM); then
    SIGKILL to whatever is left, this process's own group never included. A torchrun worker runs in a session of
    its own (torch's SubprocessHandler), so a signal to torchrun's group alone would miss it.
    """
    if pid is None or pid <= 0:
        return []
    own = os.getpgrp()
    seen = [pid, *descendants(pid)]
    if polite:
        for p in seen:
            if _group(p) not in (own, None):
                signal_group(p, signal.SIGTERM)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(alive(p) for p in seen):
            time.sleep(0.05)
    seen = list(dict.fromkeys([*seen, *descendants(pid)]))
    for p in seen:
        if alive(p):
            if _group(p) not in (own, None):
                signal_group(p, signal.SIGKILL)
            else:
                try:
                    os.kill(p, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    end = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < end and any(alive(p) for p in seen):
        time.sleep(0.02)
    return [p for p in seen if alive(p)]


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
