"""nbgrader's cell metadata on the course's exercises, so an instructor can use nbgrader on the worked notebooks as
they are (instructor guide, section 6).

Each code cell with a ``### BEGIN SOLUTION`` region is an nbgrader "autograded answer" (solution, not locked), and
the check cell after it, the one ``python -m course_lib grade`` scores, is an "autograder test" worth 1 point
(graded, locked). Both graders then score the same cells the same way: a check cell that runs without error earns
its exercise's point. ``python -m course_lib.classroom.nbgrader_marks notebooks/*.ipynb`` writes the marks (run it after
adding an exercise); ``--check`` only says which are missing or stale.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .grade import exercises
from .student import BEGIN, _source

SCHEMA = 3  # nbgrader's cell-metadata schema version (nbgrader 0.6 and later)


def _slug(label: str) -> str:
    """'Exercise 5b.1' -> 'exercise-5b-1': nbgrader's grade ids allow letters, digits, '-' and '_' only."""
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def marks(nb: dict) -> dict[int, dict]:
    """The nbgrader metadata each exercise cell of a worked notebook must carry, by cell index."""
    out = {}
    for ex in exercises(nb):
        slug = _slug(ex.label)
        solution = max(i for i in range(ex.check_index) if BEGIN in _source(nb["cells"][i]))
        out[solution] = {"grade": False, "grade_id": f"{slug}-answer", "locked": False, "schema_version": SCHEMA,
                         "solution": True, "task": False}
        out[ex.check_index] = {"grade": True, "grade_id": f"{slug}-check", "locked": True, "points": 1,
                               "schema_version": SCHEMA, "solution": False, "task": False}
    for i, cell in enumerate(nb["cells"]):   # a solution region nbgrader would clear must be marked as one
        if cell["cell_type"] == "code" and BEGIN in _source(cell) and i not in out:
            raise ValueError(f"cell {cell.get('id', i)} holds a solution but no check cell follows it")
    return out


def stale(nb: dict) -> list[str]:
    """Cells whose nbgrader metadata differs from what marks() says (missing, changed, or on a cell that is no
    longer an exercise cell), as 'cell <id>: ...' lines."""
    want = marks(nb)
    problems = []
    for i, cell in enumerate(nb["cells"]):
        have = cell.get("metadata", {}).get("nbgrader")
        if have != want.get(i):
            problems.append(f"cell {cell.get('id', i)}: nbgrader metadata {have} should be {want.get(i)}")
    return problems


def apply(nb: dict) -> int:
    """Write marks() into the notebook's cells (metadata keys kept sorted, as nbformat writes them); returns how
    many cells changed."""
    want, changed = marks(nb), 0
    for i, cell in enumerate(nb["cells"]):
        meta = dict(cell.get("metadata", {}))
        if meta.get("nbgrader") == want.get(i):
            continue
        meta.pop("nbgrader", None)
        if i in want:
            meta["nbgrader"] = want[i]
        cell["metadata"] = dict(sorted(meta.items()))
        changed += 1
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.classroom.nbgrader_marks",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="report missing or stale marks, change nothing")
    args = ap.parse_args(argv)
    bad = 0
    for path in args.notebooks:
        nb = json.loads(path.read_text(encoding="utf-8"))
        if args.check:
            for line in stale(nb):
                print(f"{path.name}: {line}")
                bad += 1
            continue
        n = apply(nb)
        if n:
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"{path.name}: {n} cell(s) marked")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
