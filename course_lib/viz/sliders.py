"""Sliders on top of a static figure (notebooks 01, 02, 06, 10, 14): ipywidgets' interact, saved without its repr.

A widget lives only while a kernel runs. Saved in a notebook it is an output with two forms: the widget view, which
JupyterLab draws only for a trusted notebook with a live kernel, and a plain-text fallback, which ipywidgets fills
with the widget's Python repr (``interactive(children=(FloatSlider(...``). A notebook opened from a clone is not
trusted, so before anything runs that repr is what a learner would see under the figure. ``sliders`` displays the
same widget with a sentence as its fallback instead: the cell's static figure stays above it, and once the cell
runs the live sliders replace the sentence.
"""

from __future__ import annotations

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
NOTE = ("Sliders: live in JupyterLab once this cell runs (they need a running kernel); "
        "the figure above shows them at their starting values.")


def bundle(widget) -> dict:
    """The widget's display data with the sentence, not the widget's repr, as its plain-text form."""
    data = dict(widget._repr_mimebundle_())
    data["text/plain"] = NOTE
    return data


def sliders(fn, **controls):
    """Like ``ipywidgets.interact(fn, **controls)``: fn runs at once with the controls' first values (its output
    goes into the widget) and again whenever one moves. Returns nothing, so the cell shows nothing more."""
    import ipywidgets as widgets
    from IPython.display import display

    display(bundle(widgets.interactive(fn, **controls)), raw=True)
