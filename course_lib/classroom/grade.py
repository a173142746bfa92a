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
        job.proc = subprocess.Popen([sys.executable, "-c", "import json, sys; from course_lib.classroom.submission "
                                     "import _worker; sys.exit(_worker(json.loads(sys.argv[1])))", json.dumps(args)],
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
