"""Grade submitted student notebooks with the course's own checkers: ``python -m course_lib grade SUBMISSIONS``.

Each submission runs top to bottom in a fresh kernel, as the student would run it. An exercise scores when its
check cell (the code cell right after the solution cell in the worked notebook, found in the submission by cell
id or identical source) runs without error. A cell that runs past the time limit is interrupted (the launcher
then ends its ranks) and costs only that exercise; a crashed kernel is restarted, the cells before the next
exercise are run again, and grading goes on. Layout: SUBMISSIONS/<student>/.../<NN_name>.ipynb, graded against
notebooks/<NN_name>.ipynb (nbgrader's submitted/<student>/<assignment>/ layout fits).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .student import _EXERCISE, BEGIN, _source

ROOT = Path(__file__).resolve().parents[1]


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
            for m in _EXERCISE.finditer(src):
                label = f"Exercise {m.group(1)}"
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


def _error_of(cell) -> str | None:
    """The error a cell ended with: its name and the first two lines of its message (the case, then the cause)."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            lines = [ln.strip() for ln in str(out.get("evalue", "")).splitlines() if ln.strip()][:2]
            return f"{out.get('ename')}: {' | '.join(lines)}"[:300]
    return None


def grade_notebook(path: Path, worked: dict, student: str, cell_timeout: float, cwd: Path) -> list[Grade]:
    """Run one submission and grade each exercise of its worked notebook."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    nb = nbformat.reads(path.read_text(encoding="utf-8"), as_version=4)
    wanted = exercises(worked)
    where = {ex.label: _locate(nb, ex) for ex in wanted}
    checks = {i: label for label, i in where.items() if i is not None}
    status: dict[str, tuple[str, str]] = {}
    crashed_at: set[int] = set()
    client = NotebookClient(nb, timeout=cell_timeout, allow_errors=True, interrupt_on_timeout=True,
                            kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    i = 0
    while i < len(nb.cells):
        with client.setup_kernel():
            if crashed_at:  # a fresh kernel: replay what came before, minus the cells that crashed the last one
                for k in range(i):
                    if nb.cells[k].cell_type == "code" and k not in crashed_at and k not in checks:
                        try:
                            client.execute_cell(nb.cells[k], k)
                        except (CellTimeoutError, DeadKernelError):
                            crashed_at.add(k)
            try:
                while i < len(nb.cells):
                    cell = nb.cells[i]
                    if cell.cell_type == "code":
                        t0 = time.monotonic()
                        client.execute_cell(cell, i)
                        if i in checks:
                            err = _error_of(cell)
                            late = time.monotonic() - t0 >= cell_timeout
                            status.setdefault(checks[i], (  # a "crashed" verdict from the solution cell stays
                                ("timeout", f"ran past {cell_timeout:g} s and was interrupted") if late and err
                                else ("failed", err) if err else ("passed", "")))
                    i += 1
            except DeadKernelError:
                crashed_at.add(i)
                if i in checks:
                    status[checks[i]] = ("crashed", "the kernel died while checking")
                # The exercise whose solution crashed the kernel is the one whose check comes next.
                nxt = next((k for k in sorted(checks) if k > i), None)
                if nxt is not None and checks[nxt] not in status:
                    status[checks[nxt]] = ("crashed", f"the kernel died in cell {i}; the solution crashed it")
                i += 1
    grades = []
    for ex in wanted:
        if where[ex.label] is None:
            grades.append(Grade(student, path.name, ex.label, 0, "missing", "check cell missing or edited"))
            continue
        st, detail = status.get(ex.label, ("not run", ""))
        grades.append(Grade(student, path.name, ex.label, int(st == "passed"), st, detail or ""))
    return grades


def grade_all(submissions: Path, worked_dir: Path, out_dir: Path, cell_timeout: float = 120.0) -> list[Grade]:
    """Grade every notebook under ``submissions``; write grades.csv and summary.md into ``out_dir``."""
    grades: list[Grade] = []
    for path in sorted(submissions.rglob("*.ipynb")):
        if ".ipynb_checkpoints" in path.parts:
            continue
        student = path.relative_to(submissions).parts[0]
        student = Path(student).stem if student.endswith(".ipynb") else student
        worked_path = worked_dir / path.name
        if not worked_path.exists():
            print(f"skipping {path}: no worked notebook {worked_path.name} in {worked_dir}", file=sys.stderr)
            continue
        worked = json.loads(worked_path.read_text(encoding="utf-8"))
        t0 = time.monotonic()
        got = grade_notebook(path, worked, student, cell_timeout, worked_dir)
        print(f"{student} {path.name}: {sum(g.points for g in got)}/{len(got)} in {time.monotonic() - t0:.0f} s",
              flush=True)
        grades += got
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "grades.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", "notebook", "exercise", "points", "status", "detail"])
        w.writerows([[g.student, g.notebook, g.exercise, g.points, g.status, g.detail] for g in grades])
    (out_dir / "summary.md").write_text(summary(grades), encoding="utf-8")
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib grade", description=__doc__.split("\n")[0])
    ap.add_argument("submissions", help="folder with one sub-folder per student")
    ap.add_argument("--worked", default=str(ROOT / "notebooks"), help="folder of the worked notebooks")
    ap.add_argument("--out", default="grades", help="where grades.csv and summary.md go (default grades/)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per cell before it is interrupted")
    args = ap.parse_args(argv)
    subs = Path(args.submissions)
    if not subs.is_dir():
        print(f"{subs} is not a folder of submissions (expected SUBMISSIONS/<student>/<notebook>.ipynb)",
              file=sys.stderr)
        return 2
    grades = grade_all(subs, Path(args.worked), Path(args.out), args.timeout)
    print(summary(grades))
    return 0


if __name__ == "__main__":
    sys.exit(main())
