"""The student build: solutions replaced by NotImplementedError, nothing of an answer left (no output, no saved
widget state, no solution line), only the course's notebooks copied, the report true; and every student copy
runs with errors only at exercise cells, and only NotImplementedError."""

import json
import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from course_lib.classroom.student import BEGIN, COURSE_NOTEBOOKS, END, main, strip_solutions
from course_lib.classroom.submission import execute

from .student_cells import cells_needed

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
    assert not missing, f"add {missing} to COURSE_NOTEBOOKS in course_lib/classroom/student.py (the manifest)"
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
    """Run the cells a student copy can change (tests/student_cells.py, cells_needed: the exercises, what uses a
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
        assert o.ename in ("NotImplementedError", "NotAttempted"), (
            f"{worked.name} cell {keep[i]}: {o.ename}: {o.evalue}")
        if i in solution_cells:
            continue
        # A check cell reached before the learner wrote anything (Run All): one line, nothing of the checker.
        shown = "\n".join(o.traceback)
        where = f"{worked.name} cell {keep[i]}"
        assert len(o.traceback) == 1 and "\n" not in shown.strip(), f"{where}: more than one line:\n{shown}"
        assert re.fullmatch(r"Exercise \S+: not attempted yet\. .*", shown.strip()), f"{where}: {shown}"
        assert "course_lib/" not in shown and "Hint" not in shown, f"{where}: {shown}"
        library = {ln.strip() for p in (ROOT / "course_lib" / "checks").glob("*.py")
                   for ln in p.read_text(encoding="utf-8").splitlines() if len(ln.strip()) > 12}
        assert not [ln for ln in shown.splitlines() if ln.strip() in library], f"{where}: a checker's line: {shown}"
    checks = [i + 1 for i in solution_cells]
    assert all(run.cells[i].execution_count is not None for i in checks)  # every check cell ran


def test_the_copies_go_where_jupyterlab_opens_and_nbval_leaves_them_out():
    """The default folder is inside notebooks/ (the README's `jupyter lab notebooks/`) and nbval does not collect it."""
    import inspect
    import runpy

    assert 'Path("notebooks") / "student"' in inspect.getsource(main)
    assert runpy.run_path(str(ROOT / "notebooks" / "conftest.py"))["collect_ignore"] == ["student"]


def test_worked_notebooks_fold_every_solution_and_student_copies_show_the_cell_to_write_in():
    from course_lib.classroom.student import BEGIN, student_notebook

    folded = 0
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code" and BEGIN in "".join(cell["source"]):
                # JupyterLab shows a folded input the learner opens on purpose; nbval and nbgrader still run it
                assert cell["metadata"].get("jupyter", {}).get("source_hidden") is True, f"{path.name} {cell['id']}"
                folded += 1
        copy, _ = student_notebook(nb)
        assert not any(c["metadata"].get("jupyter", {}).get("source_hidden") for c in copy["cells"])
    assert folded >= 40


def test_no_notebook_names_a_file_relative_to_its_own_folder():
    """A copy in notebooks/student/ and the grader (which runs submissions from notebooks/) read the same files only
    if no cell opens "../data/..." or "data/...": the notebooks go through course_lib's paths (hardware.DATA_DIR)."""
    relative = re.compile(r"""(?<![\w.])[rbfu]?["'](?:\.\./|\./|data/|course_lib/)""")
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "code":
                found += [f"{path.name} {cell.get('id')}: {m.group(0)}" for m in relative.finditer(_src(cell))]
    assert not found, found
