"""The library's shape: no module imports another that imports it back (directly or around a loop), no class
over 200 lines. Read from the source, so it costs no import."""

from __future__ import annotations

import ast
import functools

from tests.conftest import ROOT

PACKAGE = ROOT / "course_lib"


@functools.cache
def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the course_lib modules its import statements name (anywhere in it, functions included)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, tree in mods.items():
        is_package = (PACKAGE / "/".join(name.split(".")[1:]) / "__init__.py").exists() or name == "course_lib"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = name.split(".") if is_package else name.split(".")[:-1]
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in mods and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other around a loop (Tarjan's strongly connected components)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "course_lib.runtime.rank_process" in graph["course_lib.runtime.launch"]  # it reads real imports


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_no_class_is_longer_than_200_lines():
    long = [(name, node.name, node.end_lineno - node.lineno + 1)
            for name, tree in _modules().items() for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 200]
    assert long == []


def test_the_rank_server_and_viz_load_no_launcher():
    # the package's __init__ is lazy (PEP 562): what the rank server and the drawings import stays small
    import subprocess
    import sys

    code = ("import sys, course_lib.runtime.forkserver, course_lib.viz.bandwidth; "
            "print(sorted(m for m in sys.modules if m.startswith('course_lib.runtime.') and m.split('.')[2] in "
            "('launch', 'rank_process', 'transfer', 'persistent_ranks', 'results', 'devices')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    import course_lib

    assert callable(course_lib.run) and course_lib.RankFailed.__name__ == "RankFailed"  # still there on first use


def test_every_test_the_architecture_notes_name_exists():
    # docs/ARCHITECTURE.md says which test checks each claim: a renamed or deleted test must not leave a claim bare
    import re

    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    named = set(re.findall(r"\b(test_[a-z0-9_]+)\b", text))
    defined = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_[a-z0-9_]+)", path.read_text(encoding="utf-8"), re.M))
        defined.add(path.stem)
    assert len(named) > 40
    assert sorted(named - defined) == []


RUNTIME = "course_lib.runtime"
LESSONS = ("course_lib.checks", "course_lib.training", "course_lib.collectives", "course_lib.labs",
           "course_lib.measure", "course_lib.bench", "course_lib.viz", "course_lib.costs")


def test_the_layers_keep_their_import_rules():
    # docs/ARCHITECTURE.md section 2: the runtime knows no lesson; drawing never starts ranks; lesson code never grades
    graph = import_graph()
    runtime = {m for m in graph if m.startswith(RUNTIME)}
    assert len(runtime) > 20, sorted(runtime)  # the runtime package is where the import graph finds it
    knows_lessons = sorted((m, t) for m in runtime for t in graph[m] if t.startswith(LESSONS))
    assert knows_lessons == [], knows_lessons
    viz_starts_ranks = sorted((m, t) for m in graph if m.startswith("course_lib.viz") for t in graph[m] if t in runtime)
    assert viz_starts_ranks == [], viz_starts_ranks
    lessons_grade = sorted((m, t) for m in graph
                           if m.startswith(("course_lib.training", "course_lib.collectives", "course_lib.measure"))
                           for t in graph[m] if t.startswith(("course_lib.checks", "course_lib.classroom.grade")))
    assert lessons_grade == [], lessons_grade


def test_the_layout_map_matches_the_package():
    # docs/ARCHITECTURE.md section 0: one line per entry of the package root, at most 12 of them (issue 27)
    import re

    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    block = text.split("## 0. The layout", 1)[1].split("```", 2)[1]
    mapped = re.findall(r"^  (\S+)\s{2,}\S", block, re.M)
    assert len(mapped) == len(set(mapped)), mapped
    tree = sorted(p.name + ("/" if p.is_dir() else "") for p in PACKAGE.iterdir()
                  if p.name != "__pycache__" and (p.suffix == ".py" or (p / "__init__.py").exists()))
    assert sorted(mapped) == tree
    assert len(tree) <= 12, tree


def test_every_lesson_module_names_the_notebook_that_teaches_it():
    # docs/ARCHITECTURE.md section 0: a lesson's parts share a module name across the role folders, and each says
    # which notebook teaches it (d2l's "defined in section ..."); the shared machinery of every lesson is exempt
    import ast
    import re

    shared = {"checks/core.py", "checks/switch_off.py", "measure/c10d_ops.py"}
    numbers = {p.name.split("_")[0] for p in (ROOT / "notebooks").glob("*.ipynb")}
    silent = []
    for folder in ("training", "collectives", "costs", "measure", "viz", "labs", "checks"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            name = f"{folder}/{path.name}"
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            named = set(re.findall(r"notebooks?[ /]+(\d{2}b?)", doc, re.I))   # "notebook 12", "notebooks/06_..."
            if path.name != "__init__.py" and name not in shared and not named & numbers:
                silent.append(name)
    assert silent == [], silent
