"""A function written in a notebook leaves it as a torchrun script: notebook 09's hand-written data parallel, exported
and run under `torchrun --standalone --nproc-per-node=2`, ends with single-process SGD's weights."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_lib.classroom import export
from course_lib.training import train_single
from course_lib.training.tolerance import max_diff, sgd_atol

ROOT = Path(__file__).resolve().parents[1]
NB09 = ROOT / "notebooks" / "09_all_reduce_data_parallel.ipynb"


def _cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


@pytest.fixture(scope="module")
def shell():
    """An IPython shell, as the notebook's kernel: functions defined in it live in __main__ with their cell source."""
    from IPython.core.interactiveshell import InteractiveShell

    return InteractiveShell.instance()


def _define_from_notebook(shell, path: Path, name: str):
    """Run the notebook's first code cell (its imports) and the definition of `name` from the cell that holds it."""
    cells = _cells(path)
    defining = next(c for c in cells if f"def {name}(" in c)
    node = next(n for n in ast.parse(defining).body if isinstance(n, ast.FunctionDef) and n.name == name)
    for code in (cells[0], ast.get_source_segment(defining, node)):
        assert shell.run_cell(code).success
    return shell.user_ns[name]


def _torchrun(script: Path, cwd: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), "--out", str(cwd / "results"), "--timeout", "60"]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_notebook_09s_manual_data_parallel_runs_under_torchrun_with_single_process_weights(shell, tmp_path):
    manual_dp = _define_from_notebook(shell, NB09, "manual_dp")
    script = tmp_path / "manual_dp.py"
    export.export(manual_dp, script, args=(5,), world_size=2)
    text = script.read_text()
    # The script carries the function as written in the notebook and imports what it used from the course.
    assert "def manual_dp(steps, lr=0.1, batch=32):" in text and "dist.all_reduce(p.grad)" in text
    assert re.search(r"^from course_lib\.training\.data import .*load_digits", text, re.M)
    assert "dist.init_process_group" in text and "run(" not in text.replace("torch.distributed.run", "")
    _torchrun(script, tmp_path)
    reference, _ = train_single(n_workers=2, steps=5, batch_size=32)
    # float32 summation order: the two ranks' gradients are summed by all-reduce, the reference sums the combined
    # batch of 64 in one pass; sgd_atol carries that bound through 5 SGD steps of lr 0.1 (widths up to 256)
    tol = sgd_atol(steps=5, lr=0.1, batch=2 * 32, width=256)
    for rank in range(2):
        params, calls = torch.load(tmp_path / "results" / f"rank{rank}.pt")
        assert max_diff(params, reference) <= tol, f"rank {rank} is {max_diff(params, reference):.2e} away"
        assert calls == 5 * 6                          # one all-reduce per parameter tensor (6) per step


def test_ranks_cells_export_as_one_script_that_keeps_each_ranks_namespace(tmp_path):
    history = ["%ranks start 4", "%%ranks\nstale = 1",          # before the last start: left out
               "%ranks start 2",
               "%%ranks\nt = torch.ones(3, device=device) * (rank + 1)",
               "%%ranks 0\nt *= 10",                          # rank 0 only
               "%%ranks --catch\nraise RuntimeError('a demo of a failure')",
               "%%ranks\ndist.all_reduce(t)\nt.sum().item()"]
    cells = export.ranks_cells(history)
    assert [r for _, r in cells] == [None, [0], None] and "stale" not in str(cells)
    script = tmp_path / "cells.py"
    export.export_ranks(script, world_size=2, history=history)
    done = _torchrun(script, tmp_path)
    # rank 0 holds 10s, rank 1 holds 2s: the all-reduce gives 12 in each of 3 entries, on both ranks
    assert "[rank 0] 36.0" in done.stdout and "[rank 1] 36.0" in done.stdout, done.stdout
    for rank in range(2):
        assert torch.equal(torch.load(tmp_path / "results" / f"rank{rank}.pt")["t"], torch.full((3,), 12.0))


def test_a_name_a_script_cannot_recreate_is_refused_with_what_to_do(shell):
    assert shell.run_cell("import threading\nLOCK = threading.Lock()\ndef f():\n    return LOCK.locked()").success
    with pytest.raises(export.ExportError, match="'LOCK', a lock made in the notebook: build it inside"):
        export.script_for(shell.user_ns["f"])
    with pytest.raises(export.ExportError, match="not a function defined in the notebook"):
        export.script_for(max_diff)
