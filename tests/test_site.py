"""The course site: built from the committed notebooks with one command, then read in a real headless Chromium.

Every page is reached from the home page by following links; each must load without a console error, show every
image it has, and link only to pages and anchors that exist. Without Chromium (Debian's `chromium` and
`chromium-driver`, which `.ci/run` installs) the browser test is skipped and says why.
"""

import json
import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlparse

import pytest

pytest.importorskip("myst_nb", reason="the site needs the test extra: pip install -e '.[test]'")

from course_lib.classroom import site  # noqa: E402

# myst-parser reads an attribute Sphinx 9 deprecates for Sphinx 11: the build's own warnings are what this file checks
pytestmark = pytest.mark.filterwarnings("ignore:.*MystReferenceResolver.app.*")

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return site.build_site(tmp_path_factory.mktemp("site") / "_site")


def test_a_slider_output_becomes_the_note_and_the_figure_stays():
    nb = {"metadata": {"widgets": {"state": {}}}, "cells": [
        {"cell_type": "markdown", "id": "t", "metadata": {}, "source": "# title"},
        {"cell_type": "code", "id": "c", "metadata": {}, "execution_count": 1, "source": "interact(f)", "outputs": [
            {"output_type": "display_data", "metadata": {}, "data": {"image/png": "iVBOR", "text/plain": "<Figure>"}},
            {"output_type": "display_data", "metadata": {}, "data": {
                site.WIDGET_VIEW: {"model_id": "abc"}, "text/plain": "interactive(children=(FloatSlider("}}]}]}
    page = site.page_notebook(nb, "01_x.ipynb")
    outs = page["cells"][2]["outputs"]
    assert outs[0]["data"]["image/png"] == "iVBOR"
    assert site.SLIDER_NOTE in outs[1]["data"]["text/plain"] and site.WIDGET_VIEW not in outs[1]["data"]
    assert "interactive(children" not in json.dumps(page) and "widgets" not in page["metadata"]
    assert "jupyter lab notebooks/01_x.ipynb" in page["cells"][1]["source"]
    assert nb["cells"][1]["outputs"][1]["data"][site.WIDGET_VIEW]  # the notebook itself is untouched


def test_the_table_of_contents_lists_every_lesson_in_teaching_order(built):
    index = built.read_text(encoding="utf-8")
    linked = list(dict.fromkeys(re.findall(r'href="notebooks/(\d\d\w*?)\.html"', index)))  # body, then sidebar
    lessons = [p.stem for p in site.notebooks()]
    assert linked == lessons and lessons[0].startswith("00") and "05b_collectives_cell_by_cell" in lessons
    assert lessons.index("05_collectives") < lessons.index("05b_collectives_cell_by_cell") < lessons.index(
        "06_build_your_own_collectives")
    for page in ("glossary.html", "notebooks/INSTRUCTOR_GUIDE.html", "docs/ARCHITECTURE.html", "readme.html"):
        assert f'href="{page}"' in index, page
    glossary = (built.parent / "glossary.html").read_text(encoding="utf-8")
    assert "全规约" in glossary                     # the Chinese names are there
    slider_page = (built.parent / "notebooks" / "01_why_distributed.html").read_text(encoding="utf-8")
    assert "interactive(children" not in slider_page and site.SLIDER_NOTE in slider_page


def _chromium(profile: Path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra")
    from selenium.webdriver.chrome.service import Service

    if not (CHROMIUM and DRIVER):
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium chromium-driver): "
                    "the site is built and its table of contents checked, but no browser reads it")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,900", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(DRIVER))


def _ids(path: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', path.read_text(encoding="utf-8")))


LINKS = "return [...document.querySelectorAll('a[href]')].map(a => a.href)"
IMAGES = ("return [...document.images].map(i => [i.getAttribute('src'), i.complete, i.naturalWidth, "
          "i.getBoundingClientRect().width])")


def test_every_page_loads_in_chromium_with_its_images_and_links(built, tmp_path):
    driver = _chromium(tmp_path / "chromium-profile")
    try:
        driver.set_page_load_timeout(30)
        root = built.parent.resolve()
        todo, seen, problems, images_seen, external = [built.resolve()], set(), [], 0, set()
        while todo:
            page = todo.pop()
            if page in seen:
                continue
            seen.add(page)
            driver.get(page.as_uri())
            name = page.relative_to(root).as_posix()
            problems += [f"{name}: console {e['level']}: {e['message']}" for e in driver.get_log("browser")
                         if e["level"] in ("SEVERE", "WARNING")]
            for src, complete, width, shown in driver.execute_script(IMAGES):
                images_seen += 1
                if not (complete and width > 0 and shown > 0):
                    problems.append(f"{name}: image {src} did not load (naturalWidth {width})")
            for href in driver.execute_script(LINKS):
                url, fragment = urldefrag(href)
                parsed = urlparse(url)
                if parsed.scheme in ("http", "https", "mailto"):
                    external.add(url)         # the course's sources on the web: not reachable from a test
                    continue
                target = Path(unquote(parsed.path))
                if not target.is_file() or root not in target.parents:
                    problems.append(f"{name}: broken link {href}")
                elif fragment and target.suffix == ".html" and fragment not in _ids(target):
                    problems.append(f"{name}: link to a missing anchor {href}")
                elif target.suffix == ".html":
                    todo.append(target)
        expected = {root / "notebooks" / f"{p.stem}.html" for p in site.notebooks()}
        assert expected <= seen, f"pages not reachable from the home page: {sorted(expected - seen)}"
        assert not problems, "\n".join(problems)
        assert images_seen >= 50, f"only {images_seen} images on the whole site: the figures are missing"

        # The all-reduce page shows its figures: the section on all-reduce has drawn, visible images.
        driver.get((root / "notebooks" / "05_collectives.html").as_uri())
        figures = driver.execute_script("return [...document.querySelectorAll('section#all-reduce img')]"
                                        ".map(i => [i.naturalWidth, i.getBoundingClientRect().height])")
        assert figures and all(w > 0 and h > 50 for w, h in figures), figures
    finally:
        driver.quit()
