"""Every row of every data/*.csv table cites where its numbers come from: a URL or a citation a learner can look up,
or, for a table measured with the course's own tools, the date, the machine and the command. Never a file outside
the repository."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
# The course's own definitions: one Chinese and one English term per row, nothing measured or published.
NO_SOURCE_COLUMN = {"glossary.csv"}

URL = re.compile(r"https?://\S+")
CITATION = re.compile(r"arXiv:\d{4}\.\d{4,5}|\b(?:19|20)\d\d\b|\bIEEE 802|\bPCI-SIG\b|\bdatasheet\b|\bspecification\b",
                      re.IGNORECASE)
MEASURED = re.compile(r"^measured (?P<date>\d{4}-\d\d-\d\d) on (?P<machine>.+?) with: "
                      r"(?P<command>(?:python -m|torchrun) course_lib\.\S+.*)$")
OUTSIDE = re.compile(r"\.\./|\bREFERENCE\.md\b|\bPITFALLS\.md\b|\bDESIGN\.md\b|(?<![\w.:/])/(?:tmp|root|work|home)/",
                     re.IGNORECASE)
IN_REPO = re.compile(r"\b(?:data|docs|notebooks|course_lib)/[\w./-]+\.(?:csv|md|py|ipynb)\b")


def _tables():
    return sorted(p for p in DATA.glob("*.csv") if p.name not in NO_SOURCE_COLUMN)


def source_problem(source: str) -> str | None:
    """Why a `source` cell is not a source (None when it is one)."""
    source = source.strip()
    if not source:
        return "empty source"
    m = OUTSIDE.search(source)
    if m:
        return f"points outside the repository ({m.group(0)!r})"
    missing = [p for p in IN_REPO.findall(source) if not (ROOT / p).exists()]
    if missing:
        return f"names files the repository does not have: {missing}"
    if source.lower().startswith("measured"):
        m = MEASURED.match(source.split("; ")[0]) or MEASURED.match(source)
        if not m:
            return "a measured row must say 'measured YYYY-MM-DD on <machine> with: <python -m/torchrun command>'"
        if not re.search(r"\bcores?\b|\bvCPU\b|\bGPUs?\b", m["machine"]):
            return f"the machine is not described (cores, vCPUs or GPUs): {m['machine']!r}"
        return None
    if not (URL.search(source) or CITATION.search(source)):
        return "neither a URL nor a citation (authors and year, arXiv id, a standard or a datasheet)"
    return None


def test_the_rule_accepts_sources_and_rejects_pointers():
    good = ["Zhang et al. 2022, arXiv:2205.01068, section 2.5", "https://github.com/NVIDIA/nccl-tests/issues/212",
            "IEEE 802.3by (25GBASE); line rate / 8", "PCI-SIG PCIe 4.0 base specification (16 GT/s)",
            "measured 2026-12-02 on a 2-vCPU x86-64 KVM virtual machine with: python -m course_lib.bench.collectives "
            "--ranks 4", "PCI-SIG PCIe 3.0 base specification; arithmetic in data/SOURCES_hardware.md"]
    assert [source_problem(s) for s in good] == [None] * len(good)
    bad = ["", "NVIDIA nccl-tests GitHub issue, via the course's REFERENCE.md", "see ../shared/notes",
           "measured on the course build machine", "measured 2026-12-02 on a laptop with: python -m course_lib.x",
           "published, not measured here", "table in data/nowhere.csv, 2024"]
    assert all(source_problem(s) for s in bad)


@pytest.mark.parametrize("table", [p.name for p in _tables()])
def test_every_row_cites_its_source(table):
    with open(DATA / table, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        assert "source" in (reader.fieldnames or []), f"data/{table} has no `source` column"
        problems = [f"data/{table} row {i} ({next(iter(row.values()))!r}): {why}"
                    for i, row in enumerate(reader, 2) if (why := source_problem(row["source"] or ""))]
    assert not problems, "\n".join(problems)
