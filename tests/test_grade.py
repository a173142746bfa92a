"""The grader scores correct, wrong, crashing and hanging submissions, within a bound nothing can stretch: a cell
that ignores SIGINT and spins is stopped at the cell timeout and reported as a timeout (never as a NameError of a
later cell), a submission past its own bound is stopped with its kernel and everything the kernel started."""

import json
import subprocess
import sys
import time

import nbformat
import pytest

from course_lib.classroom.grade import exercises, grade_all, main
from course_lib.classroom.student import student_notebook

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
# A cell that ignores the interrupt and spins: only killing its kernel stops it. It leaves its pid and the pid of a
# child in a session of its own (as the course's rank server is) where the test can check they were ended.
SPIN = """CELL:import os, signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(os.environ["SPIN_PIDS"], "w").write(f"{os.getpid()} {child.pid}")
signal.signal(signal.SIGINT, signal.SIG_IGN)
while True:
    pass"""


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting for its parent (or init) to reap it."""
    for _ in range(50):                      # SIGKILL is delivered asynchronously: give it a moment
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state == "Z":
            return False
        time.sleep(0.1)
    return True


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
        md("## After the exercises"),
        code("raise RuntimeError('cells after the last check are never run by the grader')"),
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


def write_class(tmp_path, cases) -> tuple:
    worked_dir, subs = tmp_path / "worked", tmp_path / "submitted"
    worked_dir.mkdir(exist_ok=True)
    worked = worked_notebook()
    (worked_dir / "09_tiny.ipynb").write_text(json.dumps(worked))
    student_copy, stripped = student_notebook(worked, "9")
    assert stripped["solutions"] == 2
    for student, (mx, sm) in cases.items():
        (subs / student).mkdir(parents=True)
        (subs / student / "09_tiny.ipynb").write_text(json.dumps(submission(student_copy, mx, sm)))
    return worked_dir, subs


def test_exercises_are_found_with_their_check_cells():
    found = exercises(worked_notebook())
    assert [e.label for e in found] == ["Exercise 9.1", "Exercise 9.2"]
    assert all(e.check_source.startswith("check_collective(") for e in found)


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text and "--submission-timeout" in text and "--jobs" in text


@pytest.mark.timeout(400)
def test_correct_wrong_crashing_and_hanging_submissions(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIN_PIDS", str(tmp_path / "spin_pids"))
    worked_dir, subs = write_class(tmp_path, {
        "ada_correct": (SOLUTIONS["max"], SOLUTIONS["sum"]),
        "bob_wrong": (SOLUTIONS["sum"], SOLUTIONS["sum"]),          # 9.1 uses SUM instead of MAX
        "cy_crashing": ("CELL:os._exit(1)", SOLUTIONS["sum"]),        # the kernel itself dies in 9.1's cell
        "eve_rank_dies": ("os._exit(1)", SOLUTIONS["sum"]),           # 9.1 kills the ranks that run it
        "dee_hanging": (SOLUTIONS["max"], "time.sleep(10_000)"),     # 9.2 never finishes
        "fay_spinning": (SPIN, SOLUTIONS["sum"]),                     # 9.1's cell ignores SIGINT and spins
    })
    t0 = time.monotonic()
    grades = grade_all(subs, worked_dir, tmp_path / "out", cell_timeout=12, submission_timeout=300, jobs=3)
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
        ("fay_spinning", "Exercise 9.1"): (0, "timeout"),
        ("fay_spinning", "Exercise 9.2"): (1, "passed"),
    }, got
    assert elapsed < 300
    detail = {(g.student, g.exercise): g.detail for g in grades}
    assert "ExerciseFailed" in detail[("bob_wrong", "Exercise 9.1")] and "Exercise 9.1" in detail[("bob_wrong",
                                                                                                   "Exercise 9.1")]
    assert "exited with code 1" in detail[("eve_rank_dies", "Exercise 9.1")]
    assert detail[("fay_spinning", "Exercise 9.1")] == "cell 4 timed out after 12 s"      # not a NameError
    kernel, child = map(int, (tmp_path / "spin_pids").read_text().split())
    assert not alive(kernel) and not alive(child)      # the spinning kernel and what it started are gone
    csv_text = (tmp_path / "out" / "grades.csv").read_text()
    assert csv_text.splitlines()[0] == "student,notebook,exercise,points,status,detail"
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## ada_correct: 2/2" in summary and "## dee_hanging: 1/2" in summary


def light_class(tmp_path, first_body: str) -> tuple:
    """A worked notebook without torch (its kernel starts in about a second) and one student's submission."""
    nb = nbformat.v4.new_notebook()
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    nb.cells = [md("**Exercise 1.1** one"), code("import os\ndef one():\n    ### BEGIN SOLUTION\n    return 1\n"
                                                 "    ### END SOLUTION"), code("assert one() == 1"),
                md("**Exercise 1.2** two"), code("def two():\n    ### BEGIN SOLUTION\n    return 2\n"
                                                 "    ### END SOLUTION"), code("assert two() == 2")]
    worked = json.loads(nbformat.writes(nb))
    (tmp_path / "worked").mkdir()
    (tmp_path / "worked" / "01_light.ipynb").write_text(json.dumps(worked))
    copy, _ = student_notebook(worked, "1")
    sub = submission(copy, first_body, "return 2")
    (tmp_path / "submitted" / "gus").mkdir(parents=True)
    (tmp_path / "submitted" / "gus" / "01_light.ipynb").write_text(json.dumps(sub))
    return tmp_path / "worked", tmp_path / "submitted"


@pytest.mark.timeout(120)
def test_a_submission_past_its_bound_is_stopped_with_everything_it_started(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIN_PIDS", str(tmp_path / "spin_pids"))
    worked_dir, subs = light_class(tmp_path, SPIN)
    t0 = time.monotonic()
    grades = grade_all(subs, worked_dir, tmp_path / "out", cell_timeout=300, submission_timeout=12)
    assert time.monotonic() - t0 < 45
    assert [(g.exercise, g.status) for g in grades] == [("Exercise 1.1", "timeout"), ("Exercise 1.2", "timeout")]
    assert all(g.detail == "the submission timed out after 12 s and was stopped before this check ran"
               for g in grades)
    kernel, child = map(int, (tmp_path / "spin_pids").read_text().split())
    assert not alive(kernel) and not alive(child)


def test_grade_command_refuses_a_missing_folder(tmp_path):
    out = subprocess.run([sys.executable, "-m", "course_lib", "grade", str(tmp_path / "nope")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "is not a folder of submissions" in out.stderr
