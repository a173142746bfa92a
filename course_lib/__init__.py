"""course_lib: the helper library of the distributed-training course; notebooks import it next to torch.

The names below are loaded on first use (PEP 562), so ``import course_lib.viz`` or the rank server's
``course_lib.runtime.forkserver`` does not pay for the launcher it never uses.
"""

from __future__ import annotations

import importlib

_WHERE = {"run": "runtime.launch", "device": "runtime.devices", "plan": "runtime.devices",
          "LaunchError": "runtime.results", "RankFailed": "runtime.results", "RankTimeout": "runtime.results",
          "RunResult": "runtime.results"}

__all__ = ["run", "device", "plan", "LaunchError", "RankFailed", "RankTimeout", "RunResult"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value  # once loaded, an ordinary attribute
        return value
    try:  # a submodule asked for as an attribute (course_lib.runtime), as an eager package would have it
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise  # the submodule exists and failed to import something: that error is the story
        raise AttributeError(f"module 'course_lib' has no attribute {name!r}") from None


def load_ipython_extension(ipython) -> None:
    """``%load_ext course_lib``: the ``%ranks`` / ``%%ranks`` magic of persistent ranks (notebook 05b)."""
    from .runtime.forkserver import start_early

    # before the magic's own imports (torch): the rank server's torch import then runs beside this kernel's
    start_early(("course_lib.runtime.persistent_rank_main",))
    from .runtime.ranks_magic import load_ipython_extension as load

    load(ipython)


def __dir__():
    return sorted([*globals(), *_WHERE])
