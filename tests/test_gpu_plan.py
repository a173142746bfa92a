"""Every notebook's launches on simulated GPU machines (0-8 GPUs, no GPU needed): the backend each picks, the GPU each
rank lands on, and the algorithms that need gloo asking for it. A rank mapping that puts two ranks on one GPU, or an
algorithm that NCCL cannot run, fails here on a CPU-only CI machine."""

import ast
import itertools
import json
from pathlib import Path

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from course_lib.labs import torchrun as tr
from course_lib.runtime.devices import plan
from tests.gpu_plan import (  # noqa: F401  (simulated_gpus_fixture registers the fixture "simulated_gpus")
    assert_no_gpu_shared,
    launcher_placement,
    simulated_gpus_fixture,
    torchrun_placement,
)

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
MACHINES = (0, 1, 2, 4, 5, 8)
ANY_WORLD = tuple(range(1, 9))


# ---------------------------------------------------------------------------------------------- the rule itself
@pytest.mark.parametrize("gpus", MACHINES)
def test_torchrun_nodes_on_one_machine_never_share_a_gpu(simulated_gpus, gpus):
    machine = simulated_gpus(gpus)
    for nnodes, nproc in itertools.product((1, 2, 3), (1, 2, 4)):
        placed = torchrun_placement(machine, nnodes, nproc)
        assert_no_gpu_shared(placed)
        want = "nccl" if gpus >= nnodes * nproc or (nnodes == 1 and gpus >= nproc) else "gloo"
        assert {p.backend for p in placed} == {want}, (nnodes, nproc, placed)
        if want == "nccl":                      # worker LOCAL_RANK takes its node's GPU number LOCAL_RANK
            assert [p.gpu for p in placed] == list(range(nnodes * nproc))


def test_the_old_mapping_is_caught(simulated_gpus, monkeypatch):
    # cuda:LOCAL_RANK on every "node" of one machine, as before each node had GPUs of its own: both nodes of the
    # two-node labs land on GPU 0 ("Duplicate GPU detected" under NCCL), and the check above says so.
    machine = simulated_gpus(1)
    monkeypatch.setattr(tr, "split_gpus", lambda nnodes, nproc, gpus=None: tr.NodeGPUs((None,) * nnodes, "old"))
    with pytest.raises(AssertionError, match="two NCCL ranks on one GPU"):
        assert_no_gpu_shared(torchrun_placement(machine, nnodes=2, nproc=1))


def test_node_gpus_respects_cuda_visible_devices(simulated_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")     # a student given the second half of an 8-GPU node
    machine = simulated_gpus(8)
    placed = torchrun_placement(machine, nnodes=2, nproc=2)
    assert [p.gpu for p in placed] == [4, 5, 6, 7] and {p.backend for p in placed} == {"nccl"}
    assert tr.split_gpus(2, 2).per_node == ("0,1", "2,3")      # indexes as the workers see them
    assert "gloo" in tr.split_gpus(2, 4).reason


@pytest.mark.parametrize("gpus", MACHINES)
def test_launcher_ranks_never_share_a_gpu(simulated_gpus, gpus):
    machine = simulated_gpus(gpus)
    for world in ANY_WORLD:
        placed = launcher_placement(machine, world)
        assert_no_gpu_shared(placed)
        assert placed[0].backend == ("nccl" if gpus >= world else "gloo")


def test_a_torchrun_worker_without_a_gpu_of_its_own_is_told_why(simulated_gpus, monkeypatch):
    from course_lib.labs.group import choose
    simulated_gpus(2)
    monkeypatch.setenv("LAB_GPUS", "1")
    with pytest.raises(SystemExit, match="LOCAL_RANK 1 has no GPU of its own: LAB_GPUS='1'"):
        choose(1, 2, "nccl")


# ---------------------------------------------------------------------------------------------- the notebooks
def _code(nb_path):
    """(cell id, parsed code) of every code cell, magics and shell lines dropped."""
    for cell in json.loads(nb_path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "code":
            continue
        # IPython's own transformation: magics become get_ipython() calls, a %%ranks cell's body a string
        yield cell.get("id"), ast.parse(TransformerManager().transform_cell("".join(cell["source"])))


def _values(node, names):
    """Every value an expression can take, given the values of the names it uses; None when unknown."""
    try:
        used = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)})
        if any(u not in names for u in used):
            return None
        code = compile(ast.Expression(node), "<nb>", "eval")
        return {eval(code, {}, dict(zip(used, combo))) for combo in itertools.product(*(names[u] for u in used))}
    except Exception:
        return None


def _gloo_only(fn: ast.FunctionDef) -> str | None:
    """Why a function defined in a notebook needs gloo: a receive from any source, a monitored barrier."""
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        kws = {k.arg for k in call.keywords}
        if name in ("recv", "irecv") and len(call.args) < 2 and "src" not in kws:
            return f"dist.{name} without a source (gloo only)"
        if name == "monitored_barrier" and "group" not in kws:
            return "monitored_barrier on the default group (gloo only)"
    return None


def _launches(nb_path):
    """Every run(...) and torchrun.run/run_nodes(...) call of a notebook, with what can be told about it."""
    names, gloo_fns, out = {}, {}, []
    for cid, tree in _code(nb_path):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and _gloo_only(node):
                gloo_fns[node.name] = _gloo_only(node)
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                tgt = node.targets[0]
                if isinstance(tgt, ast.Name) and _values(node.value, names):
                    names[tgt.id] = _values(node.value, names)
                elif isinstance(tgt, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for t, v in zip(tgt.elts, node.value.elts):
                        if isinstance(t, ast.Name) and _values(v, names):
                            names[t.id] = _values(v, names)
            if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
                vals = _values(node.iter, names)
                if vals and len(vals) == 1:
                    names[node.target.id] = set(next(iter(vals)))
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            f = call.func
            attr = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            kw = {k.arg: k.value for k in call.keywords if k.arg}
            if attr in ("run_nodes", "run") and owner == "torchrun":
                nnodes = _values(kw["nnodes"], names) if "nnodes" in kw else {1}
                nproc = _values(kw["nproc"], names) if "nproc" in kw else {2}
                out.append(dict(kind="torchrun", cell=cid, nnodes=nnodes, nproc=nproc))
            elif attr == "run" and owner is None and call.args:
                fn = call.args[0]
                world = kw.get("world_size", call.args[1] if len(call.args) > 1 else None)
                backend = kw.get("backend")
                extra = kw.get("kwargs")
                mode = None
                if isinstance(extra, ast.Call):
                    mode = next((k.value for k in extra.keywords if k.arg == "mode"), None)
                elif isinstance(extra, ast.Dict):
                    mode = next((v for k, v in zip(extra.keys, extra.values)
                                 if isinstance(k, ast.Constant) and k.value == "mode"), None)
                fn_name = fn.id if isinstance(fn, ast.Name) else None
                needs = gloo_fns.get(fn_name)
                if fn_name == "ps_train" and isinstance(mode, ast.Constant) and mode.value == "async":
                    needs = "the asynchronous parameter server receives from any worker (gloo only)"
                out.append(dict(kind="run", cell=cid, fn=fn_name, needs_gloo=needs,
                                world=(_values(world, names) if world is not None else {4}) or set(ANY_WORLD),
                                backend=backend.value if isinstance(backend, ast.Constant) else
                                ("auto" if backend is None else None)))
    return out


LAUNCHES = {nb.name: _launches(nb) for nb in NOTEBOOKS}


def test_the_scan_sees_the_launches_it_must():
    runs = [x for v in LAUNCHES.values() for x in v if x["kind"] == "run"]
    nodes = [x for v in LAUNCHES.values() for x in v if x["kind"] == "torchrun"]
    assert len(runs) >= 40 and len(nodes) >= 3, (len(runs), len(nodes))
    assert any(x["needs_gloo"] for x in LAUNCHES["08_parameter_server.ipynb"])     # the asynchronous server
    assert any(x["nnodes"] == {2} for x in LAUNCHES["17_multi_node_lab.ipynb"] if x["kind"] == "torchrun")


@pytest.mark.parametrize("nb", sorted(LAUNCHES))
def test_every_launch_of_the_notebook_works_on_any_gpu_count(simulated_gpus, nb):
    for gpus in MACHINES:
        machine = simulated_gpus(gpus)
        for x in LAUNCHES[nb]:
            where = f"{nb} cell {x['cell']} on a machine with {gpus} GPU(s)"
            if x["kind"] == "torchrun":
                for nnodes, nproc in itertools.product(x["nnodes"] or {1, 2}, x["nproc"] or {1, 2, 4}):
                    assert_no_gpu_shared(torchrun_placement(machine, nnodes, nproc))
                continue
            if x["needs_gloo"]:
                assert x["backend"] == "gloo", f"{where}: {x['needs_gloo']}, so the cell must ask for backend='gloo'"
            if x["backend"] in ("auto", "gloo"):
                for world in x["world"]:
                    placed = launcher_placement(machine, world, x["backend"])
                    assert_no_gpu_shared(placed)
                    assert plan(x["backend"], world).world_size == world, where
