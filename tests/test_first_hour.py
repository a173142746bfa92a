"""A learner's first hour: sliders read as sliders before a kernel runs, and the kernels the course's commands start
print no "Kernel is running over TCP without encryption" warning. (The README's order is tests/test_packaging.py's.)"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from course_lib.viz.sliders import NOTE, WIDGET_VIEW, bundle

ROOT = Path(__file__).resolve().parents[1]
TCP_WARNING = "Kernel is running over TCP without encryption"


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def test_committed_sliders_show_their_figure_and_a_sentence_not_the_widget_repr():
    found = 0
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        last_figure_cell = None
        code = [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
        for i, cell in enumerate(code):
            outs = cell.get("outputs", [])
            for out in outs:
                data = out.get("data", {})
                if "image/png" in data:
                    last_figure_cell = i
                if WIDGET_VIEW in data:
                    found += 1
                    where = f"{path.name} cell {cell.get('id')}"
                    # An untrusted notebook (every fresh clone) shows the plain-text form: it must be the sentence.
                    assert _text(data.get("text/plain", "")) == NOTE, f"{where}: {data.get('text/plain')!r}"
                    assert last_figure_cell is not None and i - last_figure_cell <= 1, \
                        f"{where}: no static figure in this code cell or the one before"
            assert "interactive(children" not in json.dumps(outs), f"{path.name}: a widget repr in the outputs"
    assert found >= 5   # notebooks 01 (3), 02, 06, 14: saved widget outputs


class _FakeWidget:
    def _repr_mimebundle_(self, **kwargs):
        return {"text/plain": "interactive(children=(FloatSlider(value=1.0)...", WIDGET_VIEW: {"model_id": "m1"}}


def test_the_slider_bundle_keeps_the_widget_view_and_replaces_only_the_repr():
    data = bundle(_FakeWidget())
    assert data == {"text/plain": NOTE, WIDGET_VIEW: {"model_id": "m1"}}


def _readme_execute_command() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next(m for m in re.findall(r"`(jupyter nbconvert [^`]+)`", readme) if "--inplace" in m)
    return shlex.split(line.replace("$(mktemp -d)", "{tmp}"))


def test_the_readme_re_execution_keeps_sliders_saved_as_figure_and_sentence_without_the_tcp_warning(tmp_path):
    """The README's re-execution command, as the notebooks are re-run before a release, on a small slider notebook:
    the kernel talks over local sockets (no TCP warning), and the saved output is the figure, then the sentence."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import matplotlib.pyplot as plt\n"
        "from course_lib.viz.sliders import sliders\n\n"
        "def line(slope=1.0):\n"
        "    plt.plot([0, 1], [0, slope]); plt.show()\n\n"
        "line()   # the static figure\n"
        "sliders(line, slope=(0.5, 4.0));")]
    path = tmp_path / "sliders.ipynb"
    nbformat.write(nb, path)
    folder = tmp_path / "sockets"
    folder.mkdir()
    cmd = [w.replace("{tmp}", str(folder)) for w in _readme_execute_command()]
    cmd[-1:] = [str(path)]                       # the README's notebooks/*.ipynb -> this one notebook
    # `jupyter` as the README's line names it, found next to this Python even when the environment is not activated
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert TCP_WARNING not in done.stdout + done.stderr
    assert not list(folder.iterdir()), "the kernel's sockets were left behind"
    outs = nbformat.read(path, as_version=4).cells[0].outputs
    kinds = [("image/png" in o.get("data", {}), WIDGET_VIEW in o.get("data", {})) for o in outs]
    assert kinds == [(True, False), (False, True)], kinds
    assert outs[1]["data"]["text/plain"] == NOTE


def test_in_jupyterlab_the_widget_replaces_the_static_figure_and_elsewhere_it_stays(monkeypatch):
    """A kernel JupyterLab started clears the cell's static figure for the widget; nbconvert's and nbval's do not."""
    import IPython.display
    import ipywidgets

    from course_lib.viz import sliders as module

    calls = []
    monkeypatch.setattr(ipywidgets, "interactive", lambda fn, **controls: _FakeWidget())
    monkeypatch.setattr(IPython.display, "clear_output", lambda wait=False: calls.append(("clear", wait)))
    monkeypatch.setattr(IPython.display, "display", lambda data, raw=False: calls.append(("display", data)))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    module.sliders(print, slope=(0.5, 4.0))
    assert [c[0] for c in calls] == ["display"]
    calls.clear()
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/learner/notebooks/01_why_distributed.ipynb")
    module.sliders(print, slope=(0.5, 4.0))
    assert calls == [("clear", True), ("display", {"text/plain": NOTE, WIDGET_VIEW: {"model_id": "m1"}})]


def test_a_kernel_started_as_jupyterlab_starts_it_keeps_one_output_the_widget(tmp_path, monkeypatch):
    """A slider cell run with JupyterLab's kernel environment keeps one output: the widget, no static figure above."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import matplotlib.pyplot as plt\n"
        "from course_lib.viz.sliders import sliders\n\n"
        "def line(slope=1.0):\n"
        "    plt.plot([0, 1], [0, slope]); plt.show(); print('slope', slope)\n\n"
        "line()   # the static figure\n"
        "sliders(line, slope=(0.5, 4.0));")]
    monkeypatch.setenv("JPY_SESSION_NAME", str(tmp_path / "sliders.ipynb"))   # what jupyter_server sets
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outs = nb.cells[0].outputs
    assert [sorted(o.get("data", {"stream": 1})) for o in outs] == [sorted([WIDGET_VIEW, "text/plain"])], outs
    assert outs[0]["data"]["text/plain"] == NOTE
