"""A static HTML site of the course, built from the committed executed notebooks without running them.

``python -m course_lib site`` (or ``build_site()``) lays the notebooks, the glossary, the instructor guide and the
architecture notes out in a temporary Sphinx project and builds it with myst-nb, execution off: every figure,
table and output is the committed one. A slider's live widget needs a kernel, so the site shows the static figure
the cell drew first and a note saying where the sliders work. Open ``_site/index.html`` in a browser.
"""

from __future__ import annotations

import argparse
import copy
import csv
import html
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..viz.sliders import NOTE as SLIDER_NOTE
from ..viz.sliders import WIDGET_VIEW

ROOT = Path(__file__).resolve().parents[2]
TITLE = "Distributed training, taught by running it"

CONF = f'''
project = {TITLE!r}
extensions = ["myst_nb"]
nb_execution_mode = "off"         # the committed outputs are the page: nothing runs while the site builds
nb_ipywidgets_js = {{}}             # no widget JavaScript from the web: sliders are replaced by a note
nb_merge_streams = True           # a cell's rank-tagged lines stay in one block, as in JupyterLab
myst_heading_anchors = 3
html_theme = "alabaster"
html_title = project
html_copy_source = False
html_show_sourcelink = False
# The notebooks' code lines are up to 120 characters: a wide body and a smaller code font fit them. Alabaster turns
# the sidebar into a header below page_width, so it stays within a 1280-pixel laptop screen.
html_theme_options = {{"page_width": "1240px", "sidebar_width": "220px", "body_max_width": "none",
                      "code_font_size": "0.8em", "fixed_sidebar": True}}
html_sidebars = {{"**": ["about.html", "navigation.html", "searchbox.html"]}}
exclude_patterns = ["_build"]
'''


def notebooks(root: Path = ROOT) -> list[Path]:
    """The lessons in teaching order: their file names sort that way (05 before 05b before 06)."""
    return sorted((root / "notebooks").glob("[0-9][0-9]*.ipynb"))


def open_note(name: str) -> str:
    """The "open in JupyterLab" instructions shown at the top of a notebook's page."""
    return (f"```{{admonition}} Run this notebook\n"
            f"This page is `notebooks/{name}` as committed, with the outputs of its last run. To run it yourself, "
            f"from the course folder (after the README's quick start):\n\n"
            f"    source .venv/bin/activate\n"
            f"    jupyter lab notebooks/{name}\n\n"
            f"then *Run > Run All Cells*. Sliders are live there; here they show their first figure.\n```\n")


def page_notebook(nb: dict, name: str) -> dict:
    """A copy of a notebook ready for the site: the run instructions after its title cell, every widget output
    replaced by the slider note (its saved text would be the widget's Python repr), saved widget state dropped."""
    nb = copy.deepcopy(nb)
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            if WIDGET_VIEW in out.get("data", {}):
                out["data"] = {"text/html": f'<p class="slider-note"><em>{html.escape(SLIDER_NOTE)}</em></p>',
                               "text/plain": SLIDER_NOTE}
                out["metadata"] = {}
    note = {"cell_type": "markdown", "id": "site-open-in-jupyterlab", "metadata": {}, "source": open_note(name)}
    nb["cells"].insert(1, note)
    return nb


def glossary_page(root: Path = ROOT) -> str:
    """data/glossary.csv as a page: the English term, its Chinese name, the definition."""
    rows = list(csv.DictReader((root / "data" / "glossary.csv").open(encoding="utf-8")))
    cell = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731 - a table cell holds no pipe
    lines = ["# Glossary (术语表)", "",
             f"The {len(rows)} terms of the course, with the Chinese name each gets on first use.", "",
             "| term | 中文 | definition |", "|---|---|---|"]
    lines += [f"| {cell(r['term_en'])} | {cell(r['term_zh'])} | {cell(r['definition'])} |" for r in rows]
    return "\n".join(lines) + "\n"


def index_page(lessons: list[Path]) -> str:
    """The home page: what the course is, how to run it, and the table of contents in teaching order."""
    toc = "\n".join(f"notebooks/{p.stem}" for p in lessons)
    return (f"# {TITLE}\n\n"
            "Progressive Jupyter notebooks that teach distributed deep-learning training by running real "
            "`torch.distributed` ranks from notebook cells. These pages show every notebook as committed, with its "
            "figures and outputs; to run one, install the course (quick start) and open it in JupyterLab: each "
            "page says how.\n\n"
            f"```{{toctree}}\n:caption: Start\n:maxdepth: 1\n\nreadme\n```\n\n"
            f"```{{toctree}}\n:caption: Lessons, in teaching order\n:maxdepth: 1\n\n{toc}\n```\n\n"
            "```{toctree}\n:caption: Reference\n:maxdepth: 1\n\nglossary\nnotebooks/INSTRUCTOR_GUIDE\n"
            "docs/ARCHITECTURE\n```\n")


def lay_out(src: Path, root: Path = ROOT) -> list[Path]:
    """Write the Sphinx project into ``src``, mirroring the repository's paths so relative links keep working."""
    lessons = notebooks(root)
    (src / "notebooks").mkdir(parents=True)
    (src / "docs").mkdir()
    for p in lessons:
        nb = json.loads(p.read_text(encoding="utf-8"))
        (src / "notebooks" / p.name).write_text(json.dumps(page_notebook(nb, p.name), ensure_ascii=False),
                                                encoding="utf-8")
    shutil.copy(root / "notebooks" / "INSTRUCTOR_GUIDE.md", src / "notebooks" / "INSTRUCTOR_GUIDE.md")
    shutil.copy(root / "docs" / "ARCHITECTURE.md", src / "docs" / "ARCHITECTURE.md")
    readme = (root / "README.md").read_text(encoding="utf-8").split("\n", 1)[1]  # its title is the site's
    (src / "readme.md").write_text("# Install and quick start\n" + readme, encoding="utf-8")
    (src / "glossary.md").write_text(glossary_page(root), encoding="utf-8")
    (src / "index.md").write_text(index_page(lessons), encoding="utf-8")
    (src / "conf.py").write_text(CONF, encoding="utf-8")
    return lessons


def build_site(out: str | Path = ROOT / "_site", root: Path = ROOT, quiet: bool = True) -> Path:
    """Build the site into ``out`` (replaced) and return the path of its index.html. Raises with Sphinx's
    warnings if the build fails or warns: a warning here is a broken link, a missing page or a bad output."""
    from sphinx.cmd.build import build_main

    out = Path(out).resolve()
    with tempfile.TemporaryDirectory(prefix="course-site-") as tmp:
        src = Path(tmp) / "src"
        lay_out(src, root)
        warnings = Path(tmp) / "warnings.txt"
        shutil.rmtree(out, ignore_errors=True)
        args = ["-b", "html", "-d", str(Path(tmp) / "doctrees"), "-w", str(warnings), "-n"]
        code = build_main(args + (["-q"] if quiet else []) + [str(src), str(out)])
        problems = warnings.read_text(encoding="utf-8").strip() if warnings.exists() else ""
        if code != 0 or problems:
            raise RuntimeError(f"the site build {'failed' if code else 'warned'}:\n{problems}")
    return out / "index.html"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.classroom.site", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "_site"), help="folder for the HTML (default: _site/)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    index = build_site(args.out)
    print(f"site built in {time.perf_counter() - start:.1f} s: open {index} in a browser")
    return 0


if __name__ == "__main__":
    sys.exit(main())
