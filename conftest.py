"""The notebooks run under the NCCL-rules mode in the test suite, so laptop code that would fail on GPUs fails here.

nbval starts each notebook's kernel with this process's environment; COURSE_NCCL_RULES=1 there puts every launch
of the notebook that did not choose backend="gloo" under the rules (course_lib/runtime/nccl_rules.py).
The unit tests run without it: they choose the mode per launch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent / "notebooks"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # tryfirst: before the notebook's collector starts its kernel, which inherits the environment then
    if NOTEBOOKS in Path(str(item.path)).resolve().parents:
        os.environ["COURSE_NCCL_RULES"] = "1"
    else:
        os.environ.pop("COURSE_NCCL_RULES", None)
