"""nbgrader on the course as it is: every exercise's cells carry nbgrader's metadata, and on notebook 01 (three
exercises whose checkers start no ranks: the cheapest round trip) `generate_assignment` and `autograde` score a solved
and an unsolved copy exactly as `python -m course_lib grade` does, with the instructor guide's nbgrader_config.py."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.classroom import nbgrader_marks
from course_lib.classroom.grade import exercises
from course_lib.classroom.student import BEGIN

ROOT = Path(__file__).resolve().parents[1]
NB = "01_why_distributed"
TCP_WARNING = "Kernel is running over TCP without encryption"


def _notebooks():
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]*.ipynb"))


def test_every_exercise_carries_nbgrader_marks_matching_the_course_grader():
    ids = []
    for path in _notebooks():
        nb = json.loads(path.read_text(encoding="utf-8"))
        assert nbgrader_marks.stale(nb) == [], f"{path.name}: run python -m course_lib.classroom.nbgrader_marks {path}"
        cells = nb["cells"]
        checks = {ex.check_index for ex in exercises(nb)}
        for i, cell in enumerate(cells):
            mark = cell.get("metadata", {}).get("nbgrader")
            is_solution = cell["cell_type"] == "code" and BEGIN in "".join(cell["source"])
            assert bool(mark and mark["solution"]) == is_solution, f"{path.name} cell {cell.get('id')}"
            assert bool(mark and mark["grade"]) == (i in checks), f"{path.name} cell {cell.get('id')}"
            if mark and mark["grade"]:
                assert mark["points"] == 1 and mark["locked"]
            if mark:
                ids.append((path.name, mark["grade_id"]))
        assert len({g for _, g in ids if _ == path.name}) == len([g for _, g in ids if _ == path.name])


def _guide_config() -> str:
    guide = (ROOT / "notebooks" / "INSTRUCTOR_GUIDE.md").read_text(encoding="utf-8")
    return next(b for b in re.findall(r"```python\n(.*?)```", guide, re.S) if "c.Execute.timeout" in b)


def _nbgrader_scores(course: Path) -> dict[str, dict[str, float]]:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        return {s: {g.name: g.score for g in gb.find_submission_notebook(NB, "ps1", s).grades}
                for s in ("solved", "unsolved")}


@pytest.mark.filterwarnings("ignore:Object of type .* not in session")   # nbgrader's own SQLAlchemy use
def test_nbgrader_and_the_course_grader_give_the_same_points(tmp_path, capfd, monkeypatch):
    pytest.importorskip("nbgrader", reason="nbgrader is in the test extra: pip install -e '.[test]'")
    # nbgrader runs `alembic` by name: find it next to this Python even when the environment is not activated
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config import Config

    course = tmp_path / "course"
    (course / "source" / "ps1").mkdir(parents=True)
    shutil.copy(ROOT / "notebooks" / f"{NB}.ipynb", course / "source" / "ps1")
    (course / "nbgrader_config.py").write_text(_guide_config(), encoding="utf-8")
    config = Config()
    exec((course / "nbgrader_config.py").read_text(), {"get_config": lambda: config})   # as nbgrader loads it
    config.CourseDirectory.root = str(course)
    api = NbGraderAPI(CourseDirectory(config=config), config=config)

    made = api.generate_assignment("ps1", force=True)
    assert made["success"], made["log"]
    released = json.loads((course / "release" / "ps1" / f"{NB}.ipynb").read_text(encoding="utf-8"))
    text = json.dumps(released)
    assert BEGIN not in text and text.count("raise NotImplementedError()") == 3   # three answers cleared
    assert not any(c.get("outputs") for c in released["cells"])

    for student, source in (("solved", course / "source" / "ps1"), ("unsolved", course / "release" / "ps1")):
        (course / "submitted" / student / "ps1").mkdir(parents=True)
        shutil.copy(source / f"{NB}.ipynb", course / "submitted" / student / "ps1")
        graded = api.autograde("ps1", student)
        assert graded["success"], graded["log"]
    nbgrader = _nbgrader_scores(course)

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    course_grader = subprocess.run(
        [sys.executable, "-m", "course_lib", "grade", str(course / "submitted"), "--out", str(tmp_path / "grades"),
         "--jobs", "2", "--timeout", "120"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert course_grader.returncode == 0, course_grader.stderr
    rows = list(__import__("csv").DictReader((tmp_path / "grades" / "grades.csv").open(encoding="utf-8")))
    ours = {s: {f"{nbgrader_marks._slug(r['exercise'])}-check": float(r["points"]) for r in rows if r["student"] == s}
            for s in ("solved", "unsolved")}

    assert ours == nbgrader, f"course grader {ours} vs nbgrader {nbgrader}"
    assert sum(ours["solved"].values()) == 3 and sum(ours["unsolved"].values()) == 0
    seen = capfd.readouterr()
    for out in (seen.out + seen.err, course_grader.stdout + course_grader.stderr):
        assert TCP_WARNING not in out
