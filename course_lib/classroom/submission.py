"""One submitted notebook, run in kernels the grader starts and ends; each exercise's verdict as a JSON line.

The worker side of grade.py (python -m course_lib grade): a fresh kernel runs the submission top to bottom up to
its last check cell; a cell past the timeout or a dead kernel is left out and a fresh kernel replays the cells
before the next exercise. Each kernel, its rank server and any rank still running end with runtime/ending.end_tree.
"""

from __future__ import annotations

import ast
import json
import os
import tempfile
from pathlib import Path

from ..runtime.ending import end_tree
from .grade import Exercise, exercises
from .student import _source


def _locate(sub: dict, ex: Exercise) -> int | None:
    for i, cell in enumerate(sub["cells"]):
        if cell["cell_type"] == "code" and ex.check_id and cell.get("id") == ex.check_id:
            return i if _source(cell).strip() == ex.check_source else None  # a check the student edited is void
    return next((i for i, c in enumerate(sub["cells"])
                 if c["cell_type"] == "code" and _source(c).strip() == ex.check_source), None)


def _error_of(cell) -> tuple[str, str] | None:
    """(exception name, its name and the first two lines of its message) of the error a cell ended with."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            lines = [ln.strip() for ln in str(out.get("evalue", "")).splitlines() if ln.strip()][:2]
            return out.get("ename", ""), f"{out.get('ename')}: {' | '.join(lines)}"[:300]
    return None


def _bound_names(source: str) -> set[str]:
    """Names a cell defines at top level (def, class, import, assignment); empty if it is not plain Python."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


# ------------------------------------------------------------------ processes
def kernel_manager(folder: str):
    """A kernel manager for a kernel that talks over local IPC sockets in ``folder``: no network port, and no
    "Kernel is running over TCP without encryption" warning from ipykernel."""
    from jupyter_client.manager import AsyncKernelManager

    return AsyncKernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(folder, "kernel"))


def execute(nb, cwd: Path, timeout: float) -> None:
    """Run a notebook top to bottom (errors kept in the outputs) in a fresh IPC kernel, then end that kernel and
    everything it started: nbclient leaves a kernel it did not create running (the student-copy tests use this)."""
    from nbclient import NotebookClient

    with tempfile.TemporaryDirectory(prefix="nb-") as folder:
        km = kernel_manager(folder)
        client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=True,
                                resources={"metadata": {"path": str(cwd)}})
        with client.setup_kernel():
            process = getattr(km.provisioner, "process", None)
            try:
                client.execute()
            finally:
                end_tree(km.provisioner.pid if km.provisioner is not None else None, polite=False)
                if process is not None:
                    process.wait(timeout=10)    # reap it: no zombie left behind


# ------------------------------------------------------------------ one submission, in a worker process
class _Run:
    """Runs one submission in kernels it starts and kills itself; reports each verdict as a JSON line."""

    def __init__(self, nb, checks: dict[int, str], cell_timeout: float, cwd: Path, report, pidfile: str | None,
                 ipc_dir: str):
        self.nb, self.checks, self.timeout, self.cwd = nb, checks, cell_timeout, cwd
        self.report, self.pidfile, self.ipc_dir = report, pidfile, ipc_dir
        self.status: dict[str, tuple[str, str]] = {}
        self.stopped: dict[int, str] = {}       # cell index -> why it was left out (timeout, crash)
        self.last = max(checks, default=-1)     # nothing after the last check cell decides a grade

    def verdict(self, label: str, status: str, detail: str) -> None:
        if label not in self.status:
            self.status[label] = (status, detail)
            self.report({"exercise": label, "status": status, "detail": detail})

    def _owner(self, i: int) -> str | None:
        """The exercise whose check comes next at or after cell i, if cell i is its solution or its check."""
        nxt = next((k for k in sorted(self.checks) if k >= i), None)
        if nxt is None:
            return None
        solution = next((k for k in range(nxt - 1, -1, -1) if self.nb.cells[k].cell_type == "code"), None)
        return self.checks[nxt] if i in (nxt, solution) else None

    def _missing_from_stopped(self, err: str) -> str | None:
        """If a NameError names something only a stopped cell defines, say so instead of blaming the check."""
        if not err.startswith("NameError"):
            return None
        for k, why in self.stopped.items():
            for name in _bound_names(self.nb.cells[k].source):
                if f"'{name}'" in err:
                    return f"cell {k} {why}, so {name} was never defined"
        return None

    def run(self) -> None:
        from nbclient import NotebookClient
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        i = 0
        while i <= self.last:
            km = kernel_manager(self.ipc_dir)
            client = NotebookClient(self.nb, km=km, timeout=self.timeout, allow_errors=True,
                                    interrupt_on_timeout=False, resources={"metadata": {"path": str(self.cwd)}})
            with client.setup_kernel():
                pid = km.provisioner.pid if km.provisioner is not None else None
                if self.pidfile:
                    Path(self.pidfile).write_text(str(pid))
                try:
                    if i and not self._replay(client, i):
                        continue          # a replayed cell hung or crashed: left out, start yet another kernel
                    while i <= self.last:
                        cell = self.nb.cells[i]
                        if cell.cell_type == "code":
                            client.execute_cell(cell, i)
                            if i in self.checks:
                                self._judge(i, cell)
                        i += 1
                except (CellTimeoutError, DeadKernelError) as exc:
                    self._left_out(i, isinstance(exc, CellTimeoutError))
                    i += 1
                finally:
                    end_tree(pid, polite=False)   # the kernel, its rank server and any rank still running
        for label in self.checks.values():
            self.verdict(label, "not run", "")

    def _replay(self, client, upto: int) -> bool:
        """In a fresh kernel, run the code cells before ``upto`` again, minus the checks and the cells left out."""
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        for k in range(upto):
            cell = self.nb.cells[k]
            if cell.cell_type == "code" and k not in self.stopped and k not in self.checks:
                try:
                    client.execute_cell(cell, k)
                except (CellTimeoutError, DeadKernelError) as exc:
                    self._left_out(k, isinstance(exc, CellTimeoutError))
                    return False
        return True

    def _left_out(self, i: int, timed_out: bool) -> None:
        """Cell i hung or killed its kernel: leave it out from now on; the exercise it belongs to gets the verdict."""
        why = f"timed out after {self.timeout:g} s" if timed_out else "crashed the kernel"
        self.stopped[i] = why
        owner = self._owner(i)
        if owner:
            if timed_out:
                self.verdict(owner, "timeout", f"cell {i} timed out after {self.timeout:g} s")
            else:
                where = "the check" if i in self.checks else "your solution"
                self.verdict(owner, "crashed", f"the kernel died in cell {i} ({where} crashed it)")

    def _judge(self, i: int, cell) -> None:
        label = self.checks[i]
        err = _error_of(cell)
        if err is None:
            self.verdict(label, "passed", "")
            return
        stopped = self._missing_from_stopped(err[1])
        if stopped:
            self.verdict(label, "timeout" if "timed out" in stopped else "crashed", stopped)
        else:
            self.verdict(label, "failed", err[1])


def _worker(args: dict) -> int:
    """Entry point of a worker process: grade one submission, one JSON line per exercise into args['out']."""
    import nbformat

    worked = json.loads(Path(args["worked"]).read_text(encoding="utf-8"))
    nb = nbformat.reads(Path(args["path"]).read_text(encoding="utf-8"), as_version=4)
    where = {ex.label: _locate(nb, ex) for ex in exercises(worked)}
    checks = {i: label for label, i in where.items() if i is not None}
    with open(args["out"], "a", encoding="utf-8") as out, tempfile.TemporaryDirectory(prefix="grade-") as ipc:
        def report(row):
            out.write(json.dumps(row) + "\n")
            out.flush()
        for label, i in where.items():
            if i is None:
                report({"exercise": label, "status": "missing", "detail": "check cell missing or edited"})
        _Run(nb, checks, args["cell_timeout"], Path(args["cwd"]), report, args["pidfile"], ipc).run()
    return 0
