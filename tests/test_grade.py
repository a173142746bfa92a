"""The grader scores a correct, a wrong, a crashing and a hanging submission, within a bounded time."""

import json
import time

import nbformat
import pytest

from course_lib.grade import exercises, grade_all
from course_lib.student import student_notebook

SETUP = "import os, time, torch, torch.distributed as dist\nfrom course_lib.checks import check_collective"
HELPERS = '''
def rank_values(rank, world_size, size, dtype):
    return ((torch.arange(size) * (rank + 3)) % 7 - rank).to(dtype)

def torch_max(x):
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x

def torch_sum(x):
    dist.all_reduce(x)
    return x
'''
SOLUTIONS = {
    "max": "dist.all_reduce(x, op=dist.ReduceOp.MAX)",
    "sum": "dist.all_reduce(x, op=dist.ReduceOp.SUM)",
}


def worked_notebook() -> dict:
    nb = nbformat.v4.new_notebook()
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    nb.cells = [
        md("# A tiny assignment"),
        code(SETUP),
        code(HELPERS),
        md("**Exercise 9.1 ★** element-wise maximum over ranks"),
        code(f"def all_max(x):\n    ### BEGIN SOLUTION\n    {SOLUTIONS['max']}\n    ### END SOLUTION\n    return x"),
        code("check_collective('Exercise 9.1', all_max, torch_max, rank_values, world_sizes=(2, 3), sizes=(1, 5))"),
        md("**Exercise 9.2 ★** element-wise sum over ranks"),
        code(f"def all_sum(x):\n    ### BEGIN SOLUTION\n    {SOLUTIONS['sum']}\n    ### END SOLUTION\n    return x"),
        code("check_collective('Exercise 9.2', all_sum, torch_sum, rank_values, world_sizes=(2, 3), sizes=(1, 5))"),
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return json.loads(nbformat.writes(nb))


def submission(student_copy: dict, max_body: str, sum_body: str) -> dict:
    nb = json.loads(json.dumps(student_copy))
    bodies = iter([max_body, sum_body])
    for cell in nb["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if "raise NotImplementedError" in src:
            line = next(ln for ln in src.split("\n") if "raise NotImplementedError" in ln)
            body = next(bodies)
            # "CELL:" replaces the whole cell (code the student ran at top level); else the function's body.
            cell["source"] = body[5:] if body.startswith("CELL:") else src.replace(line, "    " + body)
    return nb


def test_exercises_are_found_with_their_check_cells():
    found = exercises(worked_notebook())
    assert [e.label for e in found] == ["Exercise 9.1", "Exercise 9.2"]
    assert all(e.check_source.startswith("check_collective(") for e in found)


@pytest.mark.timeout(400)
def test_correct_wrong_crashing_and_hanging_submissions(tmp_path):
    worked_dir, subs = tmp_path / "worked", tmp_path / "submitted"
    worked_dir.mkdir()
    worked = worked_notebook()
    (worked_dir / "09_tiny.ipynb").write_text(json.dumps(worked))
    student_copy, n = student_notebook(worked, "9")
    assert n == 2
    cases = {
        "ada_correct": (SOLUTIONS["max"], SOLUTIONS["sum"]),
        "bob_wrong": (SOLUTIONS["sum"], SOLUTIONS["sum"]),          # 9.1 uses SUM instead of MAX
        "cy_crashing": ("CELL:os._exit(1)", SOLUTIONS["sum"]),        # the kernel itself dies in 9.1's cell
        "eve_rank_dies": ("os._exit(1)", SOLUTIONS["sum"]),           # 9.1 kills the ranks that run it
        "dee_hanging": (SOLUTIONS["max"], "time.sleep(10_000)"),     # 9.2 never finishes
    }
    for student, (mx, sm) in cases.items():
        (subs / student).mkdir(parents=True)
        (subs / student / "09_tiny.ipynb").write_text(json.dumps(submission(student_copy, mx, sm)))
    t0 = time.monotonic()
    grades = grade_all(subs, worked_dir, tmp_path / "out", cell_timeout=20)
    elapsed = time.monotonic() - t0
    got = {(g.student, g.exercise): (g.points, g.status) for g in grades}
    assert got == {
        ("ada_correct", "Exercise 9.1"): (1, "passed"),
        ("ada_correct", "Exercise 9.2"): (1, "passed"),
        ("bob_wrong", "Exercise 9.1"): (0, "failed"),
        ("bob_wrong", "Exercise 9.2"): (1, "passed"),
        ("cy_crashing", "Exercise 9.1"): (0, "crashed"),
        ("cy_crashing", "Exercise 9.2"): (1, "passed"),
        ("eve_rank_dies", "Exercise 9.1"): (0, "failed"),
        ("eve_rank_dies", "Exercise 9.2"): (1, "passed"),
        ("dee_hanging", "Exercise 9.1"): (1, "passed"),
        ("dee_hanging", "Exercise 9.2"): (0, "timeout"),
    }, got
    assert elapsed < 300
    wrong = next(g for g in grades if g.student == "bob_wrong" and g.points == 0)
    assert "ExerciseFailed" in wrong.detail and "Exercise 9.1" in wrong.detail
    rank_died = next(g for g in grades if g.student == "eve_rank_dies" and g.points == 0)
    assert "exited with code 1" in rank_died.detail
    csv_text = (tmp_path / "out" / "grades.csv").read_text()
    assert csv_text.splitlines()[0] == "student,notebook,exercise,points,status,detail"
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## ada_correct: 2/2" in summary and "## dee_hanging: 1/2" in summary
    print(summary)
