"""The student build: solutions replaced by NotImplementedError, outputs stripped, nothing of a solution left,
and every student copy runs to the end with errors only at exercise cells, and only NotImplementedError."""

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from course_lib.student import BEGIN, END, main, strip_solutions

ROOT = Path(__file__).resolve().parents[1]
WORKED = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if BEGIN in p.read_text(encoding="utf-8"))
RUNS = WORKED


def _src(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _regions(code):
    """(lines inside solution regions, lines outside them), stripped and non-empty."""
    inside, outside, on = set(), set(), False
    for line in code.split("\n"):
        s = line.strip()
        if s.startswith(BEGIN):
            on = True
        elif s.startswith(END):
            on = False
        elif s:
            (inside if on else outside).add(s)
    return inside, outside


def test_strip_keeps_indentation_and_surrounding_code():
    code = "def f(t):\n    x = 1\n    ### BEGIN SOLUTION\n    secret()\n    ### END SOLUTION\n    return t"
    out = strip_solutions(code, "Exercise 9.9: demo")
    want = 'def f(t):\n    x = 1\n    raise NotImplementedError("Exercise 9.9: demo: write your solution here")\n'
    assert out == want + "    return t"
    with pytest.raises(ValueError):
        strip_solutions("### BEGIN SOLUTION\nx = 1\n", "Exercise 9.9")


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    assert main([str(p) for p in WORKED] + ["--out", str(out)]) == 0
    return out


def test_there_are_worked_notebooks_with_exercises():
    assert {p.name[:2] for p in WORKED} >= {"03", "04", "05"}


@pytest.mark.parametrize("worked", WORKED, ids=lambda p: p.stem)
def test_no_solution_leaks_and_outputs_are_stripped(worked, student_dir):
    wnb = json.loads(worked.read_text(encoding="utf-8"))
    snb = json.loads((student_dir / worked.name).read_text(encoding="utf-8"))
    assert len(wnb["cells"]) == len(snb["cells"])
    text = (student_dir / worked.name).read_text(encoding="utf-8")
    assert BEGIN not in text and END not in text
    for wc, sc in zip(wnb["cells"], snb["cells"]):
        if sc["cell_type"] != "code":
            continue
        assert sc["outputs"] == [] and sc["execution_count"] is None
        inside, outside = _regions(_src(wc))
        if inside:
            student_lines = {line.strip() for line in _src(sc).split("\n")}
            leaked = (inside - outside) & student_lines
            assert not leaked, f"solution lines left in {worked.name}: {leaked}"
            assert 'raise NotImplementedError("Exercise ' in _src(sc)


@pytest.mark.parametrize("worked", RUNS, ids=lambda p: p.stem)
def test_student_copy_fails_only_at_exercises_with_not_implemented(worked, student_dir):
    nb = nbformat.read(student_dir / worked.name, as_version=4)
    env_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONPATH"] = env_path  # the kernel imports course_lib from this checkout
    NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    solution_cells = {i for i, c in enumerate(nb.cells) if "raise NotImplementedError(\"Exercise" in c.source}
    exercise_cells = solution_cells | {i + 1 for i in solution_cells}  # the solution cell and its check cell
    errors = [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert errors, "a student copy with exercises must stop at them"
    for i, o in errors:
        assert i in exercise_cells, f"{worked.name} cell {i} failed outside an exercise: {o.ename}: {o.evalue}"
        assert o.ename == "NotImplementedError", f"{worked.name} cell {i}: {o.ename}: {o.evalue}"
    assert nb.cells[-1].cell_type != "code" or nb.cells[-1].execution_count is not None  # ran to the end
