"""Build student notebooks from the worked ones: solutions replaced by NotImplementedError, outputs stripped.

Worked notebooks keep each solution between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (nbgrader's
markers, DESIGN.md "Exercises"). The student copy replaces every such region with
``raise NotImplementedError("Exercise N.M: ...")`` at the region's indentation, keeps the code around it, and
clears every output and execution count. Usage: ``python -m course_lib.student [NOTEBOOK_OR_DIR ...] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
_EXERCISE = re.compile(r"Exercise\s+(\d+\.\d+)\s*(?:\([^)]*\))?\s*[:.\-—]*\s*([^\n*]*)")


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def strip_solutions(code: str, label: str) -> str:
    """Replace every BEGIN..END SOLUTION region of ``code`` by one raise line at the BEGIN line's indentation."""
    out, inside = [], False
    for line in code.split("\n"):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise ValueError(f"{label}: '{BEGIN}' inside another solution region")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f'{indent}raise NotImplementedError("{label}: write your solution here")')
        elif stripped.startswith(END):
            if not inside:
                raise ValueError(f"{label}: '{END}' without a '{BEGIN}' before it")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{label}: '{BEGIN}' without a matching '{END}'")
    return "\n".join(out)


def student_notebook(nb: dict, number: str = "") -> tuple[dict, int]:
    """Return (the student copy of a notebook dict, how many solution regions it replaced)."""
    nb = json.loads(json.dumps(nb))  # a deep copy; the worked notebook is never touched
    label, count, title = None, 0, ""
    for cell in nb["cells"]:
        src = _source(cell)
        if cell["cell_type"] == "markdown":
            headings = list(_EXERCISE.finditer(src))
            m = headings[-1] if headings else None  # the last exercise heading before a code cell names its solutions
            if m:
                label, title = f"Exercise {m.group(1)}", m.group(2).strip().rstrip(".")
            continue
        if cell["cell_type"] != "code":
            continue
        if BEGIN in src:
            count += src.count(BEGIN)
            name = label or f"Exercise {number or '?'}.{count}"
            cell["source"] = strip_solutions(src, f"{name}: {title}" if (label and title) else name)
        cell["outputs"], cell["execution_count"] = [], None
        cell.get("metadata", {}).pop("execution", None)
    return nb, count


def build(paths, out_dir: Path) -> list[Path]:
    """Write a student copy of every notebook in ``paths`` (files or folders) into ``out_dir``."""
    notebooks = []
    for p in map(Path, paths):
        notebooks += sorted(p.glob("*.ipynb")) if p.is_dir() else [p]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in notebooks:
        nb = json.loads(path.read_text(encoding="utf-8"))
        copy, n = student_notebook(nb, path.name.split("_", 1)[0].lstrip("0") or "0")
        target = out_dir / path.name
        target.write_text(json.dumps(copy, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"{target}: {n} exercise solution(s) removed, outputs stripped")
        written.append(target)
    return written


def main(argv=None) -> int:
    """Command line: build student copies (default: every notebook in notebooks/ into student/)."""
    ap = argparse.ArgumentParser(prog="python -m course_lib student", description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", default=["notebooks"], help="worked notebooks or folders (default notebooks/)")
    ap.add_argument("--out", default="student", help="folder for the student copies (default student/)")
    args = ap.parse_args(argv)
    try:
        written = build(args.paths, Path(args.out))
    except (ValueError, OSError) as exc:
        print(f"student build failed: {exc}", file=sys.stderr)
        return 1
    if not written:
        print(f"no notebooks found in {' '.join(args.paths)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
