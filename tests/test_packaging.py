"""The install story holds together: pyproject and environment.yml list the same packages, CI runs the README."""

import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the course also runs on 3.10, where this file is skipped

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject_requirements(extra: str | None = None) -> dict[str, str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = meta["dependencies"] + (meta["optional-dependencies"][extra] if extra else [])
    return {_name(r): r.replace(" ", "") for r in reqs}


def _conda_pip_requirements() -> dict[str, str]:
    # environment.yml is simple enough to read without a YAML library: the lines under "- pip:".
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "- pip:")
    reqs = [ln.strip()[2:] for ln in lines[start + 1 :] if ln.strip().startswith("- ")]
    return {_name(r): r.replace(" ", "") for r in reqs if not r.startswith("-e")}, reqs


def test_environment_yml_installs_what_a_learner_needs_as_pyproject_says():
    pyproject = _pyproject_requirements()
    conda, raw = _conda_pip_requirements()
    assert set(conda) == set(pyproject)
    for name, req in pyproject.items():
        if name != "torch":
            assert conda[name] == req, f"{name}: environment.yml says {conda[name]}, pyproject says {req}"
    assert "-e ." in raw  # the course library itself; a learner's environment has no maintainers' tools


def test_the_torch_pin_satisfies_the_declared_range():
    pinned = _conda_pip_requirements()[0]["torch"]
    assert pinned == "torch==2.13.0"
    declared = _pyproject_requirements()["torch"]
    low = tuple(int(x) for x in re.search(r">=([\d.]+)", declared).group(1).split("."))
    assert (2, 13, 0) >= low + (0,) * (3 - len(low))


def _commands(text: str) -> list[str]:
    return [ln.split("#")[0].strip() for ln in text.splitlines() if ln.strip().startswith(("pip install", "pytest"))]


INSTALL = 'pip install "torch==2.13.0" -e ".[test]"'
LEARNER_INSTALL = 'pip install "torch==2.13.0" -e .'
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def test_ci_runs_the_readme_install_and_test_commands():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]   # the whole section, all its blocks
    blocks = quick.split("```")[1::2]
    ci = (ROOT / ".ci" / "run").read_text()
    # The README's first block installs: on CPU-only Linux the CPU build of torch first (after the install line it
    # would come too late: the CUDA build would already be there), then the course without the maintainers' tools
    # (nbgrader's menu and its warning at every `jupyter lab` start are not a learner's). CI runs the maintainers'
    # line from the tests block: its machines have no GPU and reach PyPI alone, which serves them the pinned torch.
    assert _commands(blocks[0]) == [CPU_TORCH, LEARNER_INSTALL]
    # `jupyter lab` blocks its terminal, so no command may follow it in the block that starts it.
    lab = next(b for b in blocks if "jupyter lab" in b)
    lines = [ln for ln in lab.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[-1].startswith("jupyter lab")
    # The tests: `pytest` (everything, as CI) and `pytest tests` (the quick one), each with what it costs.
    tests = next(b for b in blocks if "pytest" in b)
    assert _commands(tests) == [INSTALL, "pytest tests", "pytest"] and "minutes" in tests and "quick" in tests
    assert _commands(ci) == [INSTALL, "pytest"]


def _imports(code: str) -> set[str]:
    import ast

    try:
        tree = ast.parse(code)
    except SyntaxError:          # a cell with an IPython magic: its import lines are read one by one
        return set().union(*(_imports(ln.strip()) for ln in code.splitlines()
                             if ln.strip().startswith(("import ", "from "))))
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            names.add(n.module.split(".")[0])
    return names


def _needs(dists: set[str]) -> set[str]:
    """Every distribution that installing ``dists`` brings, as installed here (names normalized)."""
    from importlib import metadata

    seen, todo = set(), list(dists)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in reqs if "extra ==" not in r]
    return seen


def test_a_learners_install_brings_what_the_notebooks_import_and_no_maintainers_tool():
    """`pip install -e .` (the learner's line) must bring JupyterLab and every third-party module the notebooks
    and course_lib import; nbgrader, pytest and sphinx (the test and site extras) stay out of it."""
    import json
    from importlib import metadata

    base = set(_pyproject_requirements())
    assert "jupyterlab" in base
    assert not base & {"nbgrader", "pytest", "sphinx", "myst-nb", "nbval", "selenium"}
    imported = set()
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        imported |= set().union(*(_imports("".join(c["source"])) for c in cells if c["cell_type"] == "code"))
    for py in (ROOT / "course_lib").rglob("*.py"):
        if py.name != "site.py":        # the site is the [site] extra's
            imported |= _imports(py.read_text(encoding="utf-8"))
    third_party = imported - set(sys.stdlib_module_names) - {"course_lib"}
    owners = metadata.packages_distributions()
    brought = _needs(base)
    missing = {m: owners.get(m) for m in third_party if not {_name(d) for d in owners.get(m, [m])} & brought}
    assert not missing, f"imported by the notebooks or course_lib, not brought by pyproject's dependencies: {missing}"


def test_glossary_rows_are_complete_and_unique():
    import csv

    rows = list(csv.DictReader((ROOT / "data" / "glossary.csv").open(encoding="utf-8")))
    assert rows and all(r["term_en"] and r["term_zh"] and r["definition"] for r in rows)
    terms = [r["term_en"].lower() for r in rows]
    assert len(terms) == len(set(terms)), "a glossary term appears twice"
