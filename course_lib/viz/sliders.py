"""Sliders on top of a static figure (notebooks 01, 02, 06, 10, 14): ipywidgets' interact, saved without its repr.

A widget lives only while a kernel runs. Saved in a notebook it is an output with two forms: the widget view, which
JupyterLab draws only for a trusted notebook with a live kernel, and a plain-text fallback, which ipywidgets fills
with the widget's Python repr (``interactive(children=(FloatSlider(...``). A notebook opened from a clone is not
trusted, so before anything runs that repr is what a learner would see under the figure. ``sliders`` displays the
same widget with a sentence as its fallback instead.

One figure at a time: a slider cell draws its static figure first (``fn()`` at the controls' first values), then
calls ``sliders``. Where the notebook is executed to be saved (nbconvert, nbval) the static figure stays, and the
saved notebook, GitHub and the site show it above the sentence. In JupyterLab the widget's first run draws that
same figure live, so ``sliders`` replaces what the cell showed before it with the widget instead of adding a second
copy under the first.
"""

from __future__ import annotations

import os

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
NOTE = ("Sliders: live in JupyterLab once this cell runs (they need a running kernel); "
        "the figure above shows them at their starting values.")


def bundle(widget) -> dict:
    """The widget's display data with the sentence, not the widget's repr, as its plain-text form."""
    data = dict(widget._repr_mimebundle_())
    data["text/plain"] = NOTE
    return data


def live() -> bool:
    """Whether a Jupyter server (JupyterLab, Notebook) started this kernel for a notebook someone has open."""
    # jupyter_server puts the notebook's path in every kernel it starts for a session; nbconvert and nbval start
    # their kernels through jupyter_client alone, without it. The frontend itself cannot be asked: a widget tells
    # the kernel nothing when it is drawn, and an output can be replaced only while its cell is still running.
    return bool(os.environ.get("JPY_SESSION_NAME"))


def sliders(fn, **controls):
    """Like ``ipywidgets.interact(fn, **controls)``: fn runs at once with the controls' first values (its output
    goes into the widget) and again whenever one moves. Returns nothing, so the cell shows nothing more."""
    import ipywidgets as widgets
    from IPython.display import clear_output, display

    widget = widgets.interactive(fn, **controls)
    if live():
        # wait=True: the cell's static figure goes only when the widget arrives, so the output area never jumps to
        # empty; the widget's own first run shows the same figure, and it is the one the sliders move
        clear_output(wait=True)
    display(bundle(widget), raw=True)
