"""The course speaks as a course: no machine paths, no words about how it was made, no files outside the repository.

Scans every notebook (sources and outputs), notebooks/*.md, data/, course_lib/, docs/ and README.md, and fails
with the file and the place of each hit. "this machine" meaning the learner's own machine is fine, so it is not a
pattern; an example path in a command should be relative, so that it works on every machine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Absolute paths of some machine: temporary dirs, home dirs, the install's site-packages. Not inside a URL or after
# a word character (so "https://x/tmp/y" and "data/tmp/" are not hits).
MACHINE_PATH = re.compile(r"(?<![\w.:/~-])(?:/(?:tmp|root|work)/|/home/[A-Za-z_][\w.-]*/|/Users/[A-Za-z_][\w.-]*/|"
                          r"/var/folders/|[A-Za-z]:\\\\Users\\\\)|\b(?:site|dist)-packages\b")
# PyTorch's own build directory, as gloo's error messages print it: a leak only where a learner reads run output.
TORCH_BUILD_PATH = re.compile(r"(?<![\w.:/-])/__w/")
BUILD_WORDS = re.compile(r"\bthis session\b|\bother jobs\b|\bsandbox\b|\bbuild machine\b|\bno internet\b|"
                         r"\bother developers\b|\breference notes\b|\bno such machine here\b|"
                         r"\bunverified from this machine\b|\bnot re-checked\b", re.IGNORECASE)
OUTSIDE_FILES = re.compile(r"\.\./shared\b|\bDESIGN\.md\b|\bREFERENCE\.md\b|\bPITFALLS\.md\b|\bissue #\d+",
                           re.IGNORECASE)


def _text_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "notebooks").glob("*.md")), *sorted((ROOT / "data").glob("*.csv")),
             *sorted((ROOT / "data").glob("*.md")), *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted(p for p in (ROOT / "course_lib").rglob("*") if p.suffix in (".py", ".md", ".sbatch", ".txt"))
    return [p for p in files if p.is_file()]


def _notebook_lines(path: Path):
    """(place, text, is_output) for every line of every cell's source and text outputs."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    for i, cell in enumerate(nb["cells"]):
        name = f"cell {i} (id {cell.get('id')})"
        for k, line in enumerate("".join(cell["source"]).splitlines(), 1):
            yield f"{name}, source line {k}", line, False
        for out in cell.get("outputs", []):
            texts = ["".join(out["text"])] if "text" in out else []
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/"):
                    texts.append("".join(value) if isinstance(value, list) else value)
            if out.get("output_type") == "error":
                texts += [out.get("evalue", ""), *out.get("traceback", [])]
            for text in texts:
                for line in text.splitlines():
                    yield f"{name}, output", line, True


def hits(lines) -> list[str]:
    found = []
    for place, line, is_output in lines:
        for what, pattern in (("machine path", MACHINE_PATH), ("words about how the course was made", BUILD_WORDS),
                              ("a file outside the repository", OUTSIDE_FILES)):
            m = pattern.search(line)
            if m:
                found.append(f"{place}: {what} {m.group(0)!r} in: {line.strip()[:140]}")
        if is_output and TORCH_BUILD_PATH.search(line):
            found.append(f"{place}: machine path '/__w/' (torch's build directory) in: {line.strip()[:140]}")
    return found


def test_the_scanner_catches_each_kind_and_spares_ordinary_text():
    bad = ["python 3.11 (/tmp/probe/bin/python)", "see ../shared/PITFALLS.md", "as REFERENCE.md says",
           "measured on the course build machine", "other jobs were running in this sandbox", "(no internet)",
           "lib/python3.11/site-packages/nbval/plugin.py", "/home/alice/course", "fixed in issue #14"]
    assert len(hits((f"line {i}", s, False) for i, s in enumerate(bad))) == len(bad)
    assert hits([("out", "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/pair.cc:553]", True)])
    fine = ["on this machine, loopback TCP", "your machine's cores", "https://github.com/NVIDIA/nccl-tests/issues/212",
            "NVIDIA/nccl-tests issue 212", "python -m course_lib.bench.collectives --csv here.csv",
            "data/links.csv", "docs/ARCHITECTURE.md", "a build of torch", "2 cores shared by 4 ranks"]
    assert hits((f"line {i}", s, False) for i, s in enumerate(fine)) == []


def test_notebooks_say_nothing_about_how_the_course_was_made():
    found = [f"{p.relative_to(ROOT)}: {h}" for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
             for h in hits(_notebook_lines(p))]
    assert not found, "text that does not belong in course material:\n" + "\n".join(found)


def test_library_data_and_docs_say_nothing_about_how_the_course_was_made():
    found = []
    for p in _text_files():
        lines = ((f"line {k}", line, False) for k, line in
                 enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1))
        found += [f"{p.relative_to(ROOT)}: {h}" for h in hits(lines)]
    assert not found, "text that does not belong in course material:\n" + "\n".join(found)


# One sitting per notebook: the prose a learner reads before the closing "Going deeper" (the course's design rule:
# at most about 3,000 words).
SITTING_WORDS = 3000


def _words_before_going_deeper(path: Path) -> int:
    words = 0
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        cut = text.find("## Going deeper")
        words += len((text if cut < 0 else text[:cut]).split())
        if cut >= 0:
            break
    return words


def test_every_notebook_is_one_sitting():
    long = {p.name: n for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
            if (n := _words_before_going_deeper(p)) > SITTING_WORDS}
    assert not long, f"more than {SITTING_WORDS} words before 'Going deeper': {long}; move detail to Going deeper"
