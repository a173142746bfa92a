"""The student build: solutions replaced by NotImplementedError, nothing of an answer left (no output, no saved
widget state, no solution line), only the course's notebooks copied, the report true; and every student copy
runs with errors only at exercise cells, and only NotImplementedError."""

import json
import os
import shutil
from pathlib import Path

import nbformat
import pytest

from course_lib.grade import execute
from course_lib.student import BEGIN, COURSE_NOTEBOOKS, END, cells_needed, main, strip_solutions

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WORKED = [p for p in NOTEBOOKS if BEGIN in p.read_text(encoding="utf-8")]


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
    quoted = strip_solutions(code, 'Exercise 9.9: a "quoted" title')
    assert 'NotImplementedError("Exercise 9.9: a \\"quoted\\" title: write' in quoted
    with pytest.raises(ValueError):
        strip_solutions("### BEGIN SOLUTION\nx = 1\n", "Exercise 9.9")


def test_the_manifest_names_every_notebook_of_the_course():
    missing = [p.name for p in NOTEBOOKS if p.name not in COURSE_NOTEBOOKS]
    assert not missing, f"add {missing} to COURSE_NOTEBOOKS in course_lib/student.py (the student build's manifest)"
    gone = [n for n in COURSE_NOTEBOOKS if not (ROOT / "notebooks" / n).exists()]
    assert not gone, f"the manifest names notebooks that are gone: {gone}"


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    assert main(["notebooks", "--out", str(out)]) == 0
    return out


def test_there_are_worked_notebooks_with_exercises():
    assert {p.name[:2] for p in WORKED} >= {"03", "04", "05"}


def test_a_scratch_notebook_is_not_copied_and_the_report_is_true(tmp_path, capsys):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    shutil.copy(ROOT / "notebooks" / "01_why_distributed.ipynb", folder)
    shutil.copy(ROOT / "notebooks" / "03_processes_ranks_groups.ipynb", folder / "my_scratch.ipynb")
    worked = json.loads((folder / "01_why_distributed.ipynb").read_text(encoding="utf-8"))
    assert main([str(folder), "--out", str(tmp_path / "student")]) == 0
    assert sorted(p.name for p in (tmp_path / "student").iterdir()) == ["01_why_distributed.ipynb"]
    report = capsys.readouterr().out
    assert "my_scratch.ipynb: not one of the course's notebooks, not copied" in report
    outputs = sum(len(c.get("outputs", [])) for c in worked["cells"] if c["cell_type"] == "code")
    widgets = len(json.dumps(worked["metadata"]["widgets"])) / 1e3
    assert f"3 exercise solution(s) removed, {outputs} output(s) cleared, widget state removed ({widgets:.1f} kB)" \
        in report


@pytest.mark.parametrize("worked", WORKED, ids=lambda p: p.stem)
def test_no_output_no_widget_state_no_solution_line(worked, student_dir):
    wnb = json.loads(worked.read_text(encoding="utf-8"))
    text = (student_dir / worked.name).read_text(encoding="utf-8")
    snb = json.loads(text)
    assert len(wnb["cells"]) == len(snb["cells"])
    assert BEGIN not in text and END not in text
    assert "widget-state" not in text and "widgets" not in snb["metadata"]
    assert "application/vnd.jupyter.widget-view" not in text
    for wc, sc in zip(wnb["cells"], snb["cells"]):
        assert "widgets" not in sc.get("metadata", {})
        if sc["cell_type"] != "code":
            continue
        assert sc["outputs"] == [] and sc["execution_count"] is None
        inside, outside = _regions(_src(wc))
        if inside:
            leaked = (inside - outside) & {line.strip() for line in _src(sc).split("\n")}
            assert not leaked, f"solution lines left in {worked.name}: {leaked}"
            assert 'raise NotImplementedError("Exercise ' in _src(sc)


@pytest.mark.parametrize("worked", WORKED, ids=lambda p: p.stem)
def test_student_copy_fails_only_at_exercises_with_not_implemented(worked, student_dir):
    """Run the cells a student copy can change (course_lib.student.cells_needed: the exercises, what uses a
    solution, what they read, the magics that hold the ranks' state), up to the last check cell. The demos left
    out run exactly as in the worked notebook, which the notebook tests run in full."""
    nb = nbformat.read(student_dir / worked.name, as_version=4)
    keep = cells_needed(nb)
    run = nbformat.v4.new_notebook(metadata=nb.metadata)
    run.cells = [nb.cells[i] for i in keep]
    env_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONPATH"] = env_path  # the kernel imports course_lib from this checkout
    execute(run, ROOT / "notebooks", timeout=300)
    solution_cells = {i for i, c in enumerate(run.cells) if "raise NotImplementedError(\"Exercise" in c.source}
    exercise_cells = solution_cells | {i + 1 for i in solution_cells}  # the solution cell and its check cell
    errors = [(i, o) for i, c in enumerate(run.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert errors, "a student copy with exercises must stop at them"
    for i, o in errors:
        assert i in exercise_cells, f"{worked.name} cell {keep[i]} failed outside an exercise: {o.ename}: {o.evalue}"
        assert o.ename == "NotImplementedError", f"{worked.name} cell {keep[i]}: {o.ename}: {o.evalue}"
    checks = [i + 1 for i in solution_cells]
    assert all(run.cells[i].execution_count is not None for i in checks)  # every check cell ran
