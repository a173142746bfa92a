"""Build student notebooks from the worked ones: solutions replaced by NotImplementedError, nothing else given away.

Worked notebooks keep each solution between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (nbgrader's
markers). The student copy replaces every such region with ``raise NotImplementedError("Exercise N.M: ...")`` at
the region's indentation, keeps the code around it, clears every output and execution count, and drops saved
widget state (a notebook's ``metadata.widgets`` keeps the widgets' last outputs, printed answers included). Only
the course's own notebooks (COURSE_NOTEBOOKS) are copied from a folder: a learner's scratch notebook next to them
stays out. The notebooks read the course's files through course_lib's paths (hardware.DATA_DIR), not "../data",
so a copy runs unchanged from any folder, and so does the grader from notebooks/. Usage:
``python -m course_lib student [NOTEBOOK_OR_DIR ...] [--out DIR]`` (default: notebooks/ into notebooks/student/).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
_STUDENT_MARK = 'raise NotImplementedError("Exercise '   # what a solution region becomes in a student copy
# An exercise heading: "**★ Exercise 1.1.**", "### ★★ Exercise 3.1: ...", "## 3. Exercise 6.1 (★★): ...",
# "**Exercise 5b.1 (★): ...**" at the start
# of a line; a sentence that merely mentions an exercise ("Exercise 8.3 bounds staleness ...") is not one.
_EXERCISE = re.compile(r"(?m)^\s*(?:#+\s*(?:\d+\.\s*)?|\*\*)\s*(?:★+\s*)?Exercise\s+(\d+[a-z]?\.\d+)\s*(?:\([^)]*\))?"
                       r"\s*[:.\-—]*\s*([^\n*]*)")

# The course's notebooks, in teaching order. A new lesson adds its file here (tests/test_student.py fails until it
# does); anything else in notebooks/ is the learner's own and is never copied.
COURSE_NOTEBOOKS = (
    "00_start_here.ipynb",
    "01_why_distributed.ipynb",
    "02_cluster_architecture.ipynb",
    "03_processes_ranks_groups.ipynb",
    "04_point_to_point.ipynb",
    "05_collectives.ipynb",
    "05b_collectives_cell_by_cell.ipynb",
    "06_build_your_own_collectives.ipynb",
    "07_measuring_communication.ipynb",
    "08_parameter_server.ipynb",
    "09_all_reduce_data_parallel.ipynb",
    "10_ps_vs_all_reduce.ipynb",
    "11_decentralized_training.ipynb",
    "11b_local_sgd_diloco_compression.ipynb",
    "12_sharded_data_parallel.ipynb",
    "13_tensor_parallel.ipynb",
    "14_pipeline_parallel.ipynb",
    "14b_activation_memory_and_precision.ipynb",
    "15_expert_parallel_and_mesh.ipynb",
    "15b_context_parallel_and_layouts.ipynb",
    "16_failures_and_recovery.ipynb",
    "17_multi_node_lab.ipynb",
    "18_debugging_distributed_training.ipynb",
)
# Notebook metadata that holds outputs: ipywidgets' saved state (with the widgets' last outputs).
_OUTPUT_METADATA = ("widgets",)


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def exercise_ids(markdown: str) -> list[tuple[str, str]]:
    """(id, title) of every exercise heading in a markdown cell, in order: [("5b.1", "reduce to one rank"), ...]."""
    return [(m.group(1), m.group(2).strip(" ★").rstrip(".")) for m in _EXERCISE.finditer(markdown)]


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
            message = json.dumps(f"{label}: write your solution here", ensure_ascii=False)   # quotes escaped
            out.append(f"{indent}raise NotImplementedError({message})")
        elif stripped.startswith(END):
            if not inside:
                raise ValueError(f"{label}: '{END}' without a '{BEGIN}' before it")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{label}: '{BEGIN}' without a matching '{END}'")
    return "\n".join(out)


def student_notebook(nb: dict, number: str = "") -> tuple[dict, dict]:
    """Return (the student copy of a notebook dict, what was stripped: solutions, outputs, widget_state bytes)."""
    nb = json.loads(json.dumps(nb))  # a deep copy; the worked notebook is never touched
    stripped = {"solutions": 0, "outputs": 0, "widget_state": 0}
    for key in _OUTPUT_METADATA:
        if key in nb.get("metadata", {}):
            stripped["widget_state"] += len(json.dumps(nb["metadata"].pop(key)))
    label, title = None, ""
    for cell in nb["cells"]:
        src = _source(cell)
        if cell["cell_type"] == "markdown":
            found = exercise_ids(src)
            if found:  # the last exercise heading before a code cell names its solutions
                label, title = f"Exercise {found[-1][0]}", found[-1][1]
            continue
        for key in _OUTPUT_METADATA:
            if key in cell.get("metadata", {}):
                stripped["widget_state"] += len(json.dumps(cell["metadata"].pop(key)))
        if cell["cell_type"] != "code":
            continue
        if BEGIN in src:
            stripped["solutions"] += src.count(BEGIN)
            name = label or f"Exercise {number or '?'}.{stripped['solutions']}"
            cell["source"] = strip_solutions(src, f"{name}: {title}" if (label and title) else name)
            # the worked notebook folds its solutions away; the learner's copy shows the cell to write in
            jupyter = cell.get("metadata", {}).get("jupyter", {})
            jupyter.pop("source_hidden", None)
            if not jupyter:
                cell.get("metadata", {}).pop("jupyter", None)
        stripped["outputs"] += len(cell.get("outputs", []))
        cell["outputs"], cell["execution_count"] = [], None
        cell.get("metadata", {}).pop("execution", None)
    return nb, stripped


def course_notebooks(folder: Path) -> tuple[list[Path], list[Path]]:
    """(the course's notebooks in ``folder``, in manifest order; the other .ipynb files there, left out)."""
    present = {p.name: p for p in folder.glob("*.ipynb")}
    return ([present[n] for n in COURSE_NOTEBOOKS if n in present],
            sorted(p for n, p in present.items() if n not in COURSE_NOTEBOOKS))


def build(paths, out_dir: Path) -> list[Path]:
    """Write a student copy of every course notebook in ``paths`` (files, or folders read through the manifest)."""
    notebooks = []
    for p in map(Path, paths):
        if p.is_dir():
            mine, others = course_notebooks(p)
            notebooks += mine
            for other in others:
                print(f"{other}: not one of the course's notebooks, not copied")
        else:
            notebooks.append(p)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in notebooks:
        nb = json.loads(path.read_text(encoding="utf-8"))
        copy, s = student_notebook(nb, path.name.split("_", 1)[0].lstrip("0") or "0")
        target = out_dir / path.name
        target.write_text(json.dumps(copy, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        widgets = f", widget state removed ({s['widget_state'] / 1e3:.1f} kB)" if s["widget_state"] else ""
        print(f"{target}: {s['solutions']} exercise solution(s) removed, {s['outputs']} output(s) cleared{widgets}")
        written.append(target)
    return written


def main(argv=None) -> int:
    """Command line: build student copies (default: the course's notebooks in notebooks/ into notebooks/student/)."""
    ap = argparse.ArgumentParser(prog="python -m course_lib student", description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", default=["notebooks"], help="worked notebooks or folders (default notebooks/)")
    # inside notebooks/: the folder `jupyter lab notebooks/` opens, so a learner finds the copies in its file browser
    ap.add_argument("--out", default=str(Path("notebooks") / "student"),
                    help="folder for the student copies (default notebooks/student/)")
    args = ap.parse_args(argv)
    try:
        written = build(args.paths, Path(args.out))
    except (ValueError, OSError) as exc:
        print(f"student build failed: {exc}", file=sys.stderr)
        return 1
    if not written:
        print(f"no course notebooks found in {' '.join(args.paths)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
