"""The torchrun labs end to end: two "nodes" on this machine, an elastic restart after SIGKILL, the diagnosis demos."""

import ast
import re

import pytest
import torch

from course_lib.labs import torchrun as tr
from course_lib.labs.elastic import complete_checkpoints, reference, reference_atol
from course_lib.training.tolerance import max_diff

STEPS, EVERY, KILL_STEP = 10, 4, 6  # checkpoints after steps 3 and 7; the kill at step 6 replays steps 4-5


def _fail(results) -> str:
    return "\n\n".join(f"--- node {i} (rc {r.returncode}, {r.seconds:.1f} s) ---\n{r.output[-4000:]}"
                       for i, r in enumerate(results))


@pytest.mark.timeout(150)
def test_two_torchrun_nodes_agree():
    nodes = tr.run_nodes("course_lib.labs.hello", nnodes=2, nproc=2, timeout=120)
    assert all(n.returncode == 0 for n in nodes), _fail(nodes)
    # findall, not lines: a rank's line and torchrun's own messages share one pipe and may run together.
    lines = [re.findall(r"rank \d+/4 .*?nodes of ranks \[[^\]]*\]", n.output) for n in nodes]
    assert [len(x) for x in lines] == [2, 2], _fail(nodes)
    ranks = sorted(int(re.match(r"rank (\d+)/", ln).group(1)) for x in lines for ln in x)
    assert ranks == [0, 1, 2, 3]
    # gloo here; NCCL on a machine with a GPU for each of the 4 workers (each "node" its own two: split_gpus)
    backend = "gloo" if tr.split_gpus(2, 2).per_node[0] == "" else "nccl"
    assert all(f"backend {backend}" in ln and "all_reduce 10 == 10 ok" in ln for x in lines for ln in x)
    # Every rank reports the same rank -> node map, two ranks per node, and each torchrun ran one node's ranks.
    maps = {ln.split("nodes of ranks ")[1] for x in lines for ln in x}
    assert len(maps) == 1, maps
    node_of = ast.literal_eval(maps.pop())  # a printed list of ints
    assert sorted(node_of) == [0, 0, 1, 1]
    for x in lines:
        assert len({int(re.search(r" node (\d+) ", ln).group(1)) for ln in x}) == 1


def test_only_complete_checkpoints_count(tmp_path):
    for name, complete in [("step_00003", True), ("step_00007", False)]:
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / ".metadata").write_bytes(b"")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00003"]


@pytest.mark.timeout(200)
def test_elastic_restart_after_sigkill_gives_the_uninterrupted_weights(tmp_path):
    args = ["--steps", STEPS, "--ckpt-every", EVERY]
    plain = tr.run("course_lib.labs.elastic", [*args, "--ckpt-dir", tmp_path / "a", "--out", tmp_path / "a.pt"],
                   timeout=90)
    assert plain.returncode == 0, _fail([plain])
    killed = tr.run("course_lib.labs.elastic", [*args, "--ckpt-dir", tmp_path / "b", "--out", tmp_path / "b.pt",
                                                "--kill-rank", 1, "--kill-step", KILL_STEP],
                    max_restarts=3, timeout=90)
    assert killed.returncode == 0 and killed.seconds < 90, _fail([killed])
    # What matters, not how torchrun words its log (its "exitcode: -9" line is not printed everywhere): rank 1 did
    # kill itself, the node's workers were started again, and they resumed from the last complete checkpoint.
    assert (tmp_path / "b" / "killed_once").exists()
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a["restart"] == 0 and b["restart"] >= 1, _fail([killed])
    assert b["resumed_from"] == "step_00003" and b["recover_s"] > 0, _fail([killed])
    ref, tol = reference(STEPS, 2), reference_atol(STEPS, 2)
    for k in ref:
        # bit for bit as the uninterrupted run of the same job: the same sums in the same order on the same machine
        assert torch.equal(b["weights"][k], a["weights"][k]), k
        # the one-process reference (this test's process, other thread counts): to float32 summation order
        assert max_diff(b["weights"][k], ref[k]) <= tol, k


@pytest.mark.timeout(200)
def test_elastic_restart_across_two_torchrun_nodes(tmp_path):
    # One worker per "node": the SIGKILLed rank 1 is alone on its node, so the other node only learns of it
    # through the broken collective and the new rendezvous round, as on a real cluster.
    nodes = tr.run_nodes("course_lib.labs.elastic", ["--steps", STEPS, "--ckpt-every", EVERY, "--ckpt-dir", tmp_path,
                                                     "--out", tmp_path / "w.pt", "--kill-rank", 1,
                                                     "--kill-step", KILL_STEP],
                         nnodes=2, nproc=1, max_restarts=3, timeout=120)
    assert all(n.returncode == 0 for n in nodes), _fail(nodes)
    assert (tmp_path / "killed_once").exists(), _fail(nodes)      # rank 1 did kill itself
    rep, ref = torch.load(tmp_path / "w.pt"), reference(STEPS, 2)
    # TORCHELASTIC_RESTART_COUNT is per node agent (a node restarted because of another node's failure may say
    # 0), so the resume is what shows the restart happened.
    assert rep["resumed_from"] == "step_00003", _fail(nodes)
    assert all(max_diff(rep["weights"][k], ref[k]) <= reference_atol(STEPS, 2) for k in ref)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("demo, expected", [
    ("absent", r"Ranks 1 failed to pass monitoredBarrier in 3000 ms"),
    ("mismatch", r"Detected mismatch between collectives on ranks.*Tensor shapes"),
    ("straggler", r"straggler: rank 1 computed"),
])
def test_diagnosis_demo_ends_in_time_with_its_message(demo, expected):
    r = tr.run("course_lib.labs.diagnose", [demo], timeout=60)
    assert r.returncode == 0 and not r.timed_out, _fail([r])
    assert re.search(expected, r.output), _fail([r])


def test_a_worker_started_by_srun_reads_slurms_variables(monkeypatch):
    """One srun task per GPU, no torchrun: RANK and the rest come from SLURM_PROCID, ...; torchrun's names win."""
    from course_lib.labs.group import Env

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "node001")
    monkeypatch.setenv("MASTER_PORT", "29500")
    for k, v in dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_NODEID="1",
                     SLURM_TASKS_PER_NODE="4(x2)").items():
        monkeypatch.setenv(k, v)
    env = Env.read()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.group_rank) == (5, 8, 1, 4, 1)
    monkeypatch.setenv("RANK", "2")
    assert Env.read().rank == 2
    monkeypatch.delenv("SLURM_PROCID")
    monkeypatch.delenv("RANK")
    with pytest.raises(SystemExit, match="RANK, WORLD_SIZE not set"):
        Env.read()
