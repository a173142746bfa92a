"""What one %%ranks cell brought back from each persistent rank: output, last value, figures, or its failure.

Result assembly for persistent_ranks.py (notebooks/05b_collectives_cell_by_cell.ipynb).
"""

from __future__ import annotations

import sys
import time

from .rank_failure import FailureRecord, first_of, names
from .results import RankFailed


class CellFailed(RankFailed):
    """A cell failed on at least one rank: names the first failing rank and shows its traceback."""

    done = "finished the cell"

    def __init__(self, failure: FailureRecord, others: list[FailureRecord], still_running: list[int],
                 finished: list[int], note: str = ""):
        self.finished, self.note = finished, note
        super().__init__(failure, others, still_running)

    def returned(self) -> list[int]:
        return self.finished

    def situation(self, running: list[int], returned: list[int]) -> list[str]:
        out = []
        if running:
            were = "was" if len(running) == 1 else "were"
            out.append(f"{names(running).capitalize()} {were} still running when it failed.")
        if returned:
            had = "had" if len(returned) == 1 else "had all"
            out.append(f"{names(returned).capitalize()} {had} finished the cell.")
        return out

    def _text(self) -> str:
        return super()._text() + (f"\n\n{self.note}" if self.note else "")

    def _render_traceback_(self):  # IPython shows this instead of the kernel-side stack, which teaches nothing
        return str(self).split("\n")


class CellTimeout(RuntimeError):
    """A %%ranks cell ran past its deadline: which ranks were still busy, and where each one was."""

    def __init__(self, limit: float, busy: list[int], finished: list[int], where: str, restarted: bool):
        self.limit, self.busy, self.finished, self.where, self.restarted = limit, busy, finished, where, restarted
        done = f" {names(finished).capitalize()} had finished the cell." if finished else ""
        then = ("They stayed blocked in C++ (a collective or recv waiting for a peer), so the group was restarted: "
                "every rank's variables are gone." if restarted else
                "They were interrupted, as the stop button does; every rank keeps its variables.")
        super().__init__(f"the cell had not finished on {names(busy)} after {limit:g} s (the cell's deadline; "
                         f"%%ranks --timeout S sets another).{done}\n\n{where}\n\n{then}")

    def _render_traceback_(self):  # the report, not the kernel-side stack
        return f"{type(self).__name__}: {self}".split("\n")


_FAILURE_CLASSES: dict[str, type] = {}


def failure_class(etype: str) -> type:
    """A CellFailed subclass named after the rank's exception, so the cell shows e.g. ``ValueError``."""
    if not etype.isidentifier():
        return CellFailed
    if etype not in _FAILURE_CLASSES:
        _FAILURE_CLASSES[etype] = type(etype, (CellFailed,), {"__module__": "course_lib.runtime.interactive"})
    return _FAILURE_CLASSES[etype]


class CellResult:
    """What one cell did on each rank it ran on: output lines, last expression's repr, figures (PNG), errors."""

    def __init__(self, ranks):
        self.ranks = list(ranks)
        self.stdout = {r: "" for r in ranks}
        self.stderr = {r: "" for r in ranks}
        self.values: dict[int, str] = {}
        self.figures: dict[int, list[bytes]] = {r: [] for r in ranks}
        self.failures: list[FailureRecord] = []
        self.finished: list[int] = []  # ranks whose cell ran to its end
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

    def error(self, running_at_failure: list[int], note: str) -> CellFailed | None:
        """The exception the cell raises (named after the first failing rank's), or None if every rank succeeded."""
        if not self.failures:
            return None
        first = first_of(self.failures)
        return failure_class(first.etype)(first, [f for f in self.failures if f is not first],
                                          [r for r in running_at_failure if r != first.rank], self.finished, note)


def _display_png(png: bytes, rank: int) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:
        return
    if get_ipython() is not None:
        display(Image(data=png, format="png"), metadata={"rank": rank})


def assemble(procs, ran, seconds: float) -> CellResult:
    """A CellResult from every rank's text since the last cell and the replies of the ranks in ``ran``."""
    result = CellResult([p.rank for p in ran])
    result.seconds = seconds
    for p in procs:
        out, err = p.take_text("out"), p.take_text("err")
        if p in ran or out or err:
            result.stdout[p.rank], result.stderr[p.rank] = out, err
    for p in ran:
        tail = "\n".join(result.stderr.get(p.rank, "").rstrip("\n").split("\n")[-12:])
        if p.reply is None:
            continue
        if p.reply[0] == "died":
            code = p.reply[1]
            kind = "signal" if code is not None and code < 0 else "exit"
            result.failures.append(FailureRecord(p.rank, kind, f"exited with code {code} (its process is gone)",
                                               time.time(), exitcode=code, stderr_tail=tail))
            continue
        d = p.reply[2]
        result.figures[p.rank] = d.get("figures", [])
        if d["ok"]:
            result.finished.append(p.rank)
            if "value" in d:
                result.values[p.rank] = d["value"]
        else:
            result.failures.append(FailureRecord(p.rank, "raised", d["message"], d["time"], etype=d["etype"],
                                               frames=d["frames"], traceback=d["traceback"], phase="fn"))
    return result
