"""The install story holds together: pyproject and environment.yml list the same packages, CI runs the README."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the course also runs on 3.10, where this file is skipped

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject_requirements() -> dict[str, str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = meta["dependencies"] + meta["optional-dependencies"]["test"]
    return {_name(r): r.replace(" ", "") for r in reqs}


def _conda_pip_requirements() -> dict[str, str]:
    # environment.yml is simple enough to read without a YAML library: the lines under "- pip:".
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "- pip:")
    reqs = [ln.strip()[2:] for ln in lines[start + 1 :] if ln.strip().startswith("- ")]
    return {_name(r): r.replace(" ", "") for r in reqs if not r.startswith("-e")}, reqs


def test_environment_yml_installs_the_same_packages_as_pyproject():
    pyproject = _pyproject_requirements()
    conda, raw = _conda_pip_requirements()
    assert set(conda) == set(pyproject)
    for name, req in pyproject.items():
        if name != "torch":
            assert conda[name] == req, f"{name}: environment.yml says {conda[name]}, pyproject says {req}"
    assert "-e .[test]" in raw  # the course library itself, with its test extras


def test_the_torch_pin_satisfies_the_declared_range():
    pinned = _conda_pip_requirements()[0]["torch"]
    assert pinned == "torch==2.13.0"
    declared = _pyproject_requirements()["torch"]
    low = tuple(int(x) for x in re.search(r">=([\d.]+)", declared).group(1).split("."))
    assert (2, 13, 0) >= low + (0,) * (3 - len(low))


def _commands(text: str) -> list[str]:
    return [ln.split("#")[0].strip() for ln in text.splitlines() if ln.strip().startswith(("pip install", "pytest"))]


INSTALL = 'pip install "torch==2.13.0" -e ".[test]"'
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def test_ci_runs_the_readme_install_and_test_commands():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]   # the whole section, all its blocks
    blocks = quick.split("```")[1::2]
    ci = (ROOT / ".ci" / "run").read_text()
    # The README's first block installs: on CPU-only Linux the CPU build of torch first (after the install line it
    # would come too late: the CUDA build would already be there), then the course. CI runs the install line only:
    # its machines have no GPU and reach PyPI alone, which serves them the pinned torch.
    assert _commands(blocks[0]) == [CPU_TORCH, INSTALL]
    # `jupyter lab` blocks its terminal, so no command may follow it in the block that starts it.
    lab = next(b for b in blocks if "jupyter lab" in b)
    lines = [ln for ln in lab.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[-1].startswith("jupyter lab")
    # The tests: `pytest` (everything, as CI) and `pytest tests` (the quick one), each with what it costs.
    tests = next(b for b in blocks if "pytest" in b)
    assert _commands(tests) == ["pytest tests", "pytest"] and "minutes" in tests and "quick" in tests
    assert _commands(ci) == [INSTALL, "pytest"]


def test_glossary_rows_are_complete_and_unique():
    import csv

    rows = list(csv.DictReader((ROOT / "data" / "glossary.csv").open(encoding="utf-8")))
    assert rows and all(r["term_en"] and r["term_zh"] and r["definition"] for r in rows)
    terms = [r["term_en"].lower() for r in rows]
    assert len(terms) == len(set(terms)), "a glossary term appears twice"
