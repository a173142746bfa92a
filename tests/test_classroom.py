"""A shared machine for a class: students launching at once stay apart, and every notebook says what it needs."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUDENT = """
import json, os, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
from course_lib import LaunchError, device, plan, run

def where():
    t = __import__("torch").ones(1)
    dist.all_reduce(t)
    return os.environ.get("CUDA_VISIBLE_DEVICES"), str(device()), t.item()

out = {{"runs": [run(where, 2, output="none").values for _ in range(8)]}}
try:
    plan("nccl", 4)
except LaunchError as err:
    out["nccl_refusal"] = str(err)
print(json.dumps(out))
"""


def test_two_students_launching_at_once_get_separate_correct_runs():
    procs = {}
    for name, gpus in (("ana", "0,1"), ("ben", "2,3")):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
        procs[name] = subprocess.Popen([sys.executable, "-c", STUDENT.format(root=str(ROOT))], env=env,
                                       stdout=subprocess.PIPE, text=True)
    results = {name: json.loads(p.communicate(timeout=240)[0]) for name, p in procs.items()}
    for name, gpus in (("ana", "0,1"), ("ben", "2,3")):
        runs = results[name]["runs"]
        assert len(runs) == 8
        # Every rank saw its own student's GPU list (here no GPU exists, so each runs gloo on the CPU) and the
        # all-reduce stayed inside that student's two ranks: the sum is 2, never 4.
        assert all(values == [[gpus, "cpu", 2.0]] * 2 for values in runs), runs
        refusal = results[name]["nccl_refusal"]
        assert f"CUDA_VISIBLE_DEVICES={gpus}" in refusal and "backend='gloo'" in refusal


def test_every_notebook_says_what_it_needs_and_what_it_teaches():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        head = "\n".join("".join(c["source"]) for c in cells[:3] if c["cell_type"] == "markdown")
        assert "Needs:" in head, f"{path.name}: the top should say what it needs (CPU only, GPUs, nodes)"
        assert "What you will learn" in head, f"{path.name}: the top should list what it teaches"


def test_the_instructor_guide_covers_every_notebook():
    guide = (ROOT / "notebooks" / "INSTRUCTOR_GUIDE.md").read_text(encoding="utf-8")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert path.stem.split("_")[0] in guide, f"the guide has no plan for {path.name}"
    assert "INSTRUCTOR_GUIDE.md" in (ROOT / "README.md").read_text(encoding="utf-8")
