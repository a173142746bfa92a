"""Grade submitted student notebooks with the course's own checkers (python -m course_lib grade SUBMISSIONS).

Each submission runs top to bottom in a fresh kernel, as the student would run it, up to its last check cell. An
exercise scores when its check cell (the code cell right after the solution cell in the worked notebook, found in
the submission by cell id or identical source) runs without error. A cell that runs past --timeout is stopped:
its kernel and everything the kernel started are killed, a fresh kernel replays the cells before the next
exercise (without the stopped one) and grading goes on; the exercise it belonged to is "timeout". Every
submission also has a hard wall-clock bound (--submission-timeout): past it, its worker, its kernel and their
children are killed by process group and the exercises not graded yet are "timeout". Submissions are graded in
parallel worker processes (--jobs), each with its own kernel: nothing of one student's run can reach another's.
Layout: SUBMISSIONS/<student>/.../<NN_name>.ipynb, graded against notebooks/<NN_name>.ipynb (nbgrader's
submitted/<student>/<assignment>/ layout fits).
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..runtime.ending import end_tree
from ..runtime.loop import Loop
from .student import BEGIN, _source, exercise_ids

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Exercise:
    """One graded exercise of a worked notebook: its label and the check cell that decides it."""

    label: str
    check_index: int
    check_id: str | None
    check_source: str


@dataclass
class Grade:
    student: str
    notebook: str
    exercise: str
    points: int
    status: str  # passed | failed | timeout | crashed | missing | not run
    detail: str


def exercises(worked: dict) -> list[Exercise]:
    """The exercises of a worked notebook: each solution cell's label and the check cell after it."""
    found, label = [], None
    cells = worked["cells"]
    for i, cell in enumerate(cells):
        src = _source(cell)
        if cell["cell_type"] == "markdown":
            ids = exercise_ids(src)
            if ids:
                label = f"Exercise {ids[-1][0]}"
        elif BEGIN in src:
            j = next((k for k in range(i + 1, len(cells)) if cells[k]["cell_type"] == "code"), None)
            if j is not None and BEGIN not in _source(cells[j]):
                found.append(Exercise(label or f"exercise {len(found) + 1}", j, cells[j].get("id"),
                                      _source(cells[j]).strip()))
    return found


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


# ------------------------------------------------------------------ many submissions, in parallel workers
@dataclass
class _Job:
    student: str
    path: Path
    worked_path: Path
    out: Path
    pidfile: Path
    errfile: Path
    proc: subprocess.Popen | None = None
    started: float = 0.0
    killed: bool = False


def _start(job: _Job, cell_timeout: float, cwd: Path) -> None:
    args = {"path": str(job.path), "worked": str(job.worked_path), "out": str(job.out), "pidfile": str(job.pidfile),
            "cell_timeout": cell_timeout, "cwd": str(cwd)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with job.errfile.open("w") as err:      # a file, not a pipe: a full pipe would block the worker and its kernel
        job.proc = subprocess.Popen([sys.executable, "-c", "import json, sys; from course_lib.classroom.grade import "
                                     "_worker; sys.exit(_worker(json.loads(sys.argv[1])))", json.dumps(args)],
                                    env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=err)
    job.started = time.monotonic()


def _stop(job: _Job) -> None:
    """The hard bound: the worker's process group, then the kernel it last started and everything below it."""
    kernel = int(job.pidfile.read_text() or 0) if job.pidfile.exists() else 0
    end_tree(job.proc, polite=False)
    end_tree(kernel, polite=False)
    job.killed = True


def grade_all(submissions: Path, worked_dir: Path, out_dir: Path, cell_timeout: float = 120.0,
              submission_timeout: float = 1800.0, jobs: int = 1) -> list[Grade]:
    """Grade every notebook under ``submissions``; write grades.csv and summary.md into ``out_dir``."""
    work = Path(tempfile.mkdtemp(prefix="course_lib-grade-"))
    todo: list[_Job] = []
    for n, path in enumerate(sorted(submissions.rglob("*.ipynb"))):
        if ".ipynb_checkpoints" in path.parts:
            continue
        student = path.relative_to(submissions).parts[0]
        student = Path(student).stem if student.endswith(".ipynb") else student
        worked_path = worked_dir / path.name
        if not worked_path.exists():
            print(f"skipping {path}: no worked notebook {worked_path.name} in {worked_dir}", file=sys.stderr)
            continue
        todo.append(_Job(student, path, worked_path, work / f"{n}.jsonl", work / f"{n}.pid", work / f"{n}.err"))
    running: list[_Job] = []
    queue = list(todo)

    def tick(now: float) -> None:  # on the runtime's loop: start what may run, stop what ran too long
        while queue and len(running) < max(1, jobs):
            job = queue.pop(0)
            _start(job, cell_timeout, worked_dir)
            running.append(job)
        for job in list(running):
            if job.proc.poll() is None and now - job.started > submission_timeout:
                _stop(job)
            if job.proc.poll() is not None:
                running.remove(job)
                kernel = int(job.pidfile.read_text() or 0) if job.pidfile.exists() else 0
                end_tree(kernel, polite=False)   # nothing outlives it
                got = _grades_of(job, worked_dir, submission_timeout)
                print(f"{job.student} {job.path.name}: {sum(g.points for g in got)}/{len(got)} in "
                      f"{now - job.started:.0f} s", flush=True)

    tick(time.monotonic())
    Loop().run(lambda: not queue and not running, tick=tick)
    grades = [g for job in todo for g in _grades_of(job, worked_dir, submission_timeout)]
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "grades.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", "notebook", "exercise", "points", "status", "detail"])
        w.writerows([[g.student, g.notebook, g.exercise, g.points, g.status, g.detail] for g in grades])
    (out_dir / "summary.md").write_text(summary(grades), encoding="utf-8")
    shutil.rmtree(work, ignore_errors=True)
    return grades


def _grades_of(job: _Job, worked_dir: Path, submission_timeout: float) -> list[Grade]:
    worked = json.loads(job.worked_path.read_text(encoding="utf-8"))
    rows = {}
    if job.out.exists():
        for line in job.out.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            rows.setdefault(row["exercise"], row)
    grades = []
    for ex in exercises(worked):
        row = rows.get(ex.label)
        if row is None:
            if job.killed:
                row = {"status": "timeout", "detail": f"the submission timed out after {submission_timeout:g} s "
                                                      "and was stopped before this check ran"}
            else:
                err = job.errfile.read_text(errors="replace").strip().splitlines() if job.errfile.exists() else []
                row = {"status": "not run", "detail": f"the grader's worker ended early: {(err or ['?'])[-1]}"[:300]}
        grades.append(Grade(job.student, job.path.name, ex.label, int(row["status"] == "passed"), row["status"],
                            row["detail"]))
    return grades


def summary(grades: list[Grade]) -> str:
    """A readable report: per student, each exercise with its status and why."""
    lines = ["# Grades", ""]
    for student in sorted({g.student for g in grades}):
        mine = [g for g in grades if g.student == student]
        lines += [f"## {student}: {sum(g.points for g in mine)}/{len(mine)}", ""]
        for g in mine:
            mark = "✓" if g.points else "✗"
            why = f": {g.detail}" if g.detail else ""
            lines.append(f"- {mark} {g.notebook} {g.exercise}: {g.status}{why}")
        lines.append("")
    return "\n".join(lines)


HELP = """Grade submitted student notebooks with the course's own checkers.

Each submission runs in a fresh kernel, top to bottom, up to its last check cell. An exercise scores a point
when its check cell runs without error. A cell that runs longer than --timeout is stopped (its kernel and the
ranks it started are killed) and grading goes on in a fresh kernel; a whole submission that runs longer than
--submission-timeout is stopped, and what was not graded yet reads "timeout".

Layout: SUBMISSIONS/<student>/<NN_name>.ipynb (deeper folders are fine), graded against
notebooks/<NN_name>.ipynb. Results: grades.csv (one row per student and exercise) and summary.md.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib grade", description=HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("submissions", help="folder with one sub-folder per student")
    ap.add_argument("--worked", default=str(ROOT / "notebooks"), help="folder of the worked notebooks")
    ap.add_argument("--out", default="grades", help="where grades.csv and summary.md go (default: grades)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one cell may run (default: 120)")
    ap.add_argument("--submission-timeout", type=float, default=1800.0,
                    help="seconds one student's notebook may run in all (default: 1800)")
    ap.add_argument("--jobs", type=int, default=(os.cpu_count() or 1) + 1,
                    help="submissions graded at once, each in its own kernel (default: CPU cores + 1, the fastest "
                         "measured on 2 cores; see the instructor guide)")
    args = ap.parse_args(argv)
    subs = Path(args.submissions)
    if not subs.is_dir():
        print(f"{subs} is not a folder of submissions (expected SUBMISSIONS/<student>/<notebook>.ipynb)",
              file=sys.stderr)
        return 2
    grades = grade_all(subs, Path(args.worked), Path(args.out), args.timeout, args.submission_timeout, args.jobs)
    print(summary(grades))
    return 0


if __name__ == "__main__":
    sys.exit(main())
