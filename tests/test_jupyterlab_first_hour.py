"""The README's first hour in a real browser: `python -m course_lib student`, `jupyter lab notebooks/`, Chromium.

The student copies are built where the README's command puts them (notebooks/student/). The server runs headless on
a free local port with a token, in a temporary HOME and settings folder, so a maintainer's own JupyterLab settings
neither help nor hurt. Without Chromium (Debian's `chromium` and `chromium-driver`) the tests are skipped and say why.
"""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
BOUND = 60   # seconds for any one thing the browser waits for: a page, a kernel, a cell


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _index(notebook: Path, text: str) -> int:
    """Index of the first cell whose source contains ``text`` (JupyterLab numbers its cells the same way)."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return next(i for i, c in enumerate(cells) if text in "".join(c["source"]))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(Chromium's driver, base URL, token, server log) for JupyterLab serving notebooks/ with the copies built."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra")
    if not (CHROMIUM and DRIVER):
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium chromium-driver): "
                    "JupyterLab is not opened in a browser")
    home = tmp_path_factory.mktemp("home")
    bin_dir = os.path.dirname(sys.executable)   # `jupyter` next to this Python, activated or not
    env = {**os.environ, "HOME": str(home), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "JUPYTER_CONFIG_DIR": str(home / ".jupyter"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(home / "lab-settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "ws")}
    built = subprocess.run([sys.executable, "-m", "course_lib", "student"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    token, port = secrets.token_hex(16), _free_port()
    log = home / "jupyter.log"
    with open(log, "w") as out:
        # its own process group, so the finally below ends the server and whatever it started, and nothing else
        server = subprocess.Popen(
            [os.path.join(bin_dir, "jupyter"), "lab", "notebooks/", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
             # a container's test run is often root, which JupyterLab refuses unless told
             *(["--allow-root"] if os.geteuid() == 0 else [])],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    profile = home / "chromium"
    driver = None
    try:
        deadline = time.monotonic() + BOUND
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, f"jupyter lab exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"jupyter lab did not answer in {BOUND} s: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--window-size=1400,1000", f"--user-data-dir={profile}"):
            opts.add_argument(flag)
        driver = webdriver.Chrome(options=opts, service=Service(DRIVER))
        driver.set_page_load_timeout(BOUND)
        driver.set_script_timeout(BOUND)
        yield driver, base, token, log
    finally:
        if driver is not None:
            driver.quit()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)   # the server shuts its kernels down as it stops
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=10)


def _open(lab, path: str):
    """Open notebooks/<path> in JupyterLab and wait until its kernel is idle."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver, base, token, log = lab
    # a workspace of its own: the default one would reopen the notebook of the test before next to this one
    driver.get(f"{base}/lab/workspaces/{Path(path).stem}/tree/{path}?token={token}")
    wait = WebDriverWait(driver, BOUND)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Cell"))
    # the toolbar's kernel status: idle once the kernel has started and answered
    wait.until(lambda d: d.find_elements(
        By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']"))
    return wait


def _run_all(driver, wait):
    """Run > Run All Cells, through the menu as a learner clicks it."""
    from selenium.webdriver.common.by import By

    menu = wait.until(lambda d: next((m for m in d.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-item")
                                      if m.text.strip() == "Run"), None))
    menu.click()
    wait.until(lambda d: d.find_element(
        By.CSS_SELECTOR, ".lm-Menu-item[data-command='runmenu:run-all']")).click()


def _cell(driver, index: int):
    from selenium.webdriver.common.by import By

    found = driver.find_elements(
        By.CSS_SELECTOR, f".jp-NotebookPanel .jp-Cell[data-windowed-list-index='{index}']")
    return found[0] if found else None


def _outputs(cell) -> list[str]:
    from selenium.webdriver.common.by import By

    return [o.get_attribute("textContent") for o in cell.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output")]


def test_run_all_in_a_student_copy_stops_at_the_first_exercise_with_one_line(lab):
    """Notebook 04's copy, Run All: the stub cell shows nothing, the check cell one line, no library traceback."""
    driver = lab[0]
    copy = ROOT / "notebooks" / "student" / "04_point_to_point.ipynb"
    stub, check = _index(copy, 'raise NotImplementedError("Exercise 4.1'), _index(copy, "check_ring_exchange(")
    after = _index(copy, 'raise NotImplementedError("Exercise 4.2')
    wait = _open(lab, "student/04_point_to_point.ipynb")
    _run_all(driver, wait)
    cell = wait.until(lambda d: (c := _cell(d, check)) is not None and _outputs(c) and c)
    shown = _outputs(cell)
    assert len(shown) == 1, shown
    text = shown[0].strip()
    assert re.fullmatch(r"Exercise 4\.1: not attempted yet\. [^\n]*", text), text
    assert "Traceback" not in text and "course_lib" not in text and "File " not in text, text
    # the stub cell only defines the function: it ran, showed nothing, and Run All went on to the check
    assert re.fullmatch(r"\[\d+\]:", _cell(driver, stub).find_element("css selector", ".jp-InputPrompt").text)
    assert _outputs(_cell(driver, stub)) == []
    # Run All stops at the check's error: the next exercise's cells have not run
    prompt = _cell(driver, after).find_element("css selector", ".jp-InputPrompt").text
    assert prompt.strip() in ("[ ]:", ""), prompt


def test_a_slider_cell_shows_one_figure_the_live_one(lab):
    """Notebook 01's first slider cell in JupyterLab: one figure, the widget's live one, and its printed line once."""
    from selenium.webdriver.common.by import By

    driver = lab[0]
    copy = ROOT / "notebooks" / "student" / "01_why_distributed.ipynb"
    index = _index(copy, "sliders(memory_wall")
    wait = _open(lab, "student/01_why_distributed.ipynb")
    _run_all(driver, wait)

    def drawn(d):
        """The cell's output once the widget has drawn its figure."""
        cell = _cell(d, index)
        return cell if cell is not None and cell.find_elements(By.CSS_SELECTOR, ".widget-interact img") else None

    cell = wait.until(drawn)
    images = cell.find_elements(By.CSS_SELECTOR, ".jp-OutputArea img")
    assert len(images) == 1, f"{len(images)} figures in the slider cell's output"
    assert cell.find_elements(By.CSS_SELECTOR, ".widget-interact .widget-slider, .widget-interact .widget-dropdown")
    shown = cell.find_element(By.CSS_SELECTOR, ".jp-Cell-outputArea").get_attribute("textContent")
    assert shown.count("B params:") == 1, shown
