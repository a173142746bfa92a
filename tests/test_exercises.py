"""Every exercise of every notebook (a new lesson is found by itself) has one id, used the same in the notebook's
heading, the student copy's NotImplementedError, the checker and the grade sheet; its check cell is a cell of its
own that calls a course_lib.checks function and shows no answer (no assert, no expected value)."""

import ast
import importlib
import inspect
import json
from pathlib import Path

import pytest

from course_lib.classroom.grade import exercises
from course_lib.classroom.student import BEGIN, exercise_ids, student_notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _src(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _checker_imports(cells) -> dict[str, object]:
    """Every name a cell imports from course_lib.checks (or its modules), with the object it names."""
    names = {}
    for cell in cells:
        if cell["cell_type"] != "code" or "course_lib.checks" not in _src(cell):
            continue
        code = "\n".join(line for line in _src(cell).split("\n") if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib.checks"):
                module = importlib.import_module(node.module)
                for a in node.names:
                    names[a.asname or a.name] = getattr(module, a.name)
    return names


def _exercise_rows(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb["cells"]
    copy, _ = student_notebook(nb)
    rows = []
    for ex in exercises(nb):
        solution = max(i for i in range(ex.check_index) if cells[i]["cell_type"] == "code")
        rows.append((nb, cells, copy, ex, solution))
    return nb, rows


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_solution_has_a_graded_exercise(path):
    nb, rows = _exercise_rows(path)
    solutions = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and BEGIN in _src(c)]
    assert [s for *_, s in rows] == solutions, (
        f"{path.name}: every solution cell needs its own check cell right after it (cells {solutions})")
    labels = [ex.label for *_, ex, _ in rows]
    assert len(set(labels)) == len(labels), f"{path.name}: an exercise id is used twice: {labels}"
    number = path.name.split("_", 1)[0].lstrip("0") or "0"
    for label in labels:
        assert label.startswith(f"Exercise {number}."), f"{path.name}: {label} is not one of notebook {number}'s"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_one_id_in_heading_student_copy_checker_and_grade_sheet(path):
    nb, rows = _exercise_rows(path)
    for _, cells, copy, ex, solution in rows:
        heading = next(exercise_ids(_src(c))[-1][0] for c in reversed(cells[:solution])
                       if c["cell_type"] == "markdown" and exercise_ids(_src(c)))
        assert ex.label == f"Exercise {heading}"                                   # the grade sheet
        assert f'NotImplementedError("{ex.label}' in _src(copy["cells"][solution])  # the student copy
        checkers = _checker_imports(cells[: ex.check_index + 1])
        call = next(n.value for n in ast.parse(ex.check_source).body if isinstance(n, ast.Expr)
                    and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", None) in checkers)
        checker = checkers[call.func.id]
        given = next((k.value.value for k in call.keywords if k.arg == "exercise"), None)
        if given is None and call.args and isinstance(call.args[0], ast.Constant):
            given = call.args[0].value                                              # check_collective("Exercise..")
        if given is None:
            given = inspect.signature(checker).parameters["exercise"].default
        # the same id; a checker may add the exercise's title after it: "Exercise 11.1 (rounds to consensus)"
        assert given == ex.label or given.startswith(ex.label + " ("), (
            f"{path.name}: {call.func.id} says {given!r}, the notebook {ex.label!r}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_check_cells_call_a_checker_and_show_no_answer(path):
    nb, rows = _exercise_rows(path)
    for _, cells, _, ex, _ in rows:
        tree = ast.parse(ex.check_source)
        assert not any(isinstance(n, ast.Assert) for n in ast.walk(tree)), f"{path.name} {ex.label}: an assert"
        calls = [n.value for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
        checkers = _checker_imports(cells[: ex.check_index + 1])
        assert calls and isinstance(calls[0].func, ast.Name) and calls[0].func.id in checkers, (
            f"{path.name} {ex.label}: the check cell must call a course_lib.checks function first")
        # what the cell hands the checker: the learner's names, never numbers or literal answers
        args = [*calls[0].args, *(k.value for k in calls[0].keywords if k.arg != "exercise")]
        literals = [ast.unparse(a) for a in args if not isinstance(a, ast.Name)
                    and not (isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("Ex"))]
        assert not literals, f"{path.name} {ex.label}: the check cell passes {literals} to the checker"
