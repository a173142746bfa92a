"""A checker's message never hands over the answer: no line of the worked notebook's solution appears in a hint or
in what a wrong answer is told."""

import ast
import json
from pathlib import Path

import pytest
import torch

from course_lib.checks import ExerciseFailed
from course_lib.checks.basics import check_all_max, check_all_mean
from course_lib.checks.primitives import check_all_gather, check_broadcast, check_ring_exchange
from course_lib.classroom.student import BEGIN, END

ROOT = Path(__file__).resolve().parents[1]
# Lines too short or too common to give anything away ("return t", "else:").
SHORT = 16


def _solution_lines() -> dict[str, set[str]]:
    """Per exercise id ("4.1"), the stripped lines of its worked solution."""
    from course_lib.classroom.student import exercise_ids

    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        label = None
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            src = "".join(cell["source"])
            if cell["cell_type"] == "markdown" and exercise_ids(src):
                label = exercise_ids(src)[-1][0]
            elif cell["cell_type"] == "code" and BEGIN in src:
                inside = src.split(BEGIN, 1)[1].split(END, 1)[0]
                out.setdefault(label, set()).update(ln.strip() for ln in inside.splitlines()
                                                    if len(ln.strip()) >= SHORT)
    return out


SOLUTIONS = _solution_lines()
EVERY_LINE = set().union(*SOLUTIONS.values())


def _hints():
    """(module, line, text) of every hint literal in the checkers."""
    for path in sorted((ROOT / "course_lib" / "checks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            value = (node.value if isinstance(node, ast.keyword) and node.arg == "hint" else
                     node.value if isinstance(node, ast.Assign) and any(
                         isinstance(t, ast.Name) and t.id.lower().endswith("hint") for t in node.targets) else None)
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                yield path.name, node.lineno, value.value


def test_there_are_solutions_and_hints_to_compare():
    assert len(SOLUTIONS) >= 20 and sum(1 for _ in _hints()) >= 30


@pytest.mark.parametrize("module,line,text", list(_hints()),
                         ids=lambda v: str(v)[:20])
def test_no_hint_holds_a_line_of_a_solution(module, line, text):
    leaked = [s for s in EVERY_LINE if s in text]
    assert not leaked, f"{module}:{line}: the hint holds solution lines {leaked}"


def _unchanged(t, *args):
    return t


def _one_wrong_max(x):
    import torch.distributed as dist

    dist.all_reduce(x)          # SUM where MAX is asked
    return x


def _own_only(t):
    import torch.distributed as dist

    return [t.clone() for _ in range(dist.get_world_size())]


WRONG = [("0.1", check_all_max, _one_wrong_max, {}), ("0.2", check_all_mean, _unchanged, {}),
         ("4.1", check_ring_exchange, _unchanged, {"worlds": (2,)}),
         ("4.2", check_broadcast, _unchanged, {"worlds": (3,)}),
         ("4.3", check_all_gather, _own_only, {"worlds": (2,)})]


@pytest.mark.parametrize("exercise,check,wrong,kwargs", WRONG, ids=[w[0] for w in WRONG])
def test_a_wrong_answer_is_told_what_went_wrong_not_the_solution(exercise, check, wrong, kwargs):
    with pytest.raises(ExerciseFailed) as e:
        check(wrong, **kwargs)
    message = str(e.value)
    assert f"Exercise {exercise}: Exercise" not in message          # the id once
    assert message.startswith(f"Exercise {exercise}") and "Hint: " in message
    leaked = [s for s in SOLUTIONS[exercise] if s in message]
    assert not leaked, f"Exercise {exercise}'s message holds its solution lines {leaked}:\n{message}"
    assert "course_lib/" not in message


def test_the_checkers_own_frames_stay_out_of_what_a_notebook_shows():
    """An unattempted exercise shows one line; a failure shows the learner's frames, none of the library's."""
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.user_ns.update(check=check_all_max, torch=torch)
    shell.run_cell("def stub(x):\n    raise NotImplementedError('Exercise 0.1: the maximum: write your solution "
                   "here')\n")
    shown = []
    shell._showtraceback = lambda etype, value, stb: shown.append(stb)
    shell.run_cell("check(stub)")
    assert shown[-1] == [shown[-1][0]] and shown[-1][0].startswith("Exercise 0.1: not attempted yet.")
    shell.user_ns["wrong"] = _one_wrong_max
    shell.run_cell("check(wrong)")
    text = "\n".join(shown[-1])
    assert "ExerciseFailed" in text and "check(wrong)" in text and "course_lib/" not in text
