"""The one event loop of the runtime: it reads what processes write and keeps time, on the monotonic clock.

Every client waits here: run()'s launch (launch._Launch.watch), persistent ranks (rank_channel.Channel.wait), a
torchrun lab cell (labs/torchrun.py), the grader's workers (grade.py), the rank server's own loop
(_forkserver.serve) and ending a process tree (ending.end_tree). Each registers its pipes and sockets with what
to do when one is readable, says when it is done, and gets a tick to move through its phases;
docs/ARCHITECTURE.md, section 4, draws the launch's phases on it.
"""

from __future__ import annotations

import selectors
import time
from collections.abc import Callable

STEP_S = 0.05  # how often the loop ticks when nothing is readable: the resolution of every deadline


class Loop:
    """Readable pipes and sockets, each with a callback; ``run`` until done or past a deadline."""

    def __init__(self):
        self._sel = selectors.DefaultSelector()

    def watch(self, fileobj, on_ready: Callable[[], bool]) -> None:
        """Call ``on_ready()`` whenever ``fileobj`` is readable; it returns False once the file is finished."""
        self._sel.register(fileobj, selectors.EVENT_READ, on_ready)

    def watching(self, fileobj) -> bool:
        """``fileobj`` is still registered (its callback has not said it is finished)."""
        try:
            self._sel.get_key(fileobj)
            return True
        except (KeyError, ValueError):
            return False

    def close(self) -> None:
        """Let go of the selector (a forked child that will never run this loop)."""
        self._sel.close()

    def run(self, done: Callable[[], bool], deadline: Callable[[], float | None] | None = None,
            tick: Callable[[float], None] | None = None) -> bool:
        """Serve readable files and ``tick(now)`` until ``done()``; False if ``deadline()`` passed first."""
        try:
            while not done():
                limit = deadline() if deadline is not None else None
                if limit is not None and time.monotonic() > limit:
                    return False
                for key, _ in self._sel.select(timeout=STEP_S):
                    if not key.data():
                        self._sel.unregister(key.fileobj)
                if tick is not None:
                    tick(time.monotonic())
            return True
        finally:
            self._sel.close()


def readable(fileobj, timeout: float | None) -> bool:
    """Wait up to ``timeout`` seconds (None: for ever) until ``fileobj`` can be read: one turn of a loop."""
    with selectors.DefaultSelector() as sel:
        sel.register(fileobj, selectors.EVENT_READ)
        return bool(sel.select(timeout=timeout))
