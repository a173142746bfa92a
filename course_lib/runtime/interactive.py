"""Persistent interactive ranks, cell by cell on every rank (notebooks/05b_collectives_cell_by_cell.ipynb).

``%load_ext course_lib`` registers the ``%ranks`` / ``%%ranks`` magic (ranks_magic.py);
``Ranks`` is the same group without the magic (persistent_ranks.py). This module only gathers them.
"""

from __future__ import annotations

from .cell_result import CellFailed, CellResult
from .persistent_ranks import Ranks
from .ranks_magic import current, load_ipython_extension

__all__ = ["CellFailed", "CellResult", "Ranks", "current", "load_ipython_extension"]
