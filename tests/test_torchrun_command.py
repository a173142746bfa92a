"""torchrun.command (notebook 17): the same launch line for "nodes" on this machine and for a real head node."""

from course_lib.labs import torchrun


def test_command_targets_a_real_head_node_or_this_machine():
    real = torchrun.command("course_lib.labs.hello", nproc=4, nnodes=2, node_rank=1, port=29400, host="node001")
    assert "--rdzv-endpoint=node001:29400" in real and "--nnodes=2" in real and "--nproc-per-node=4" in real
    # a real node advertises its own address and finds the rendezvous host by name
    assert not any(a.startswith(("--local-addr", "--rdzv-conf")) for a in real)
    here = torchrun.command("course_lib.labs.hello", nnodes=2, node_rank=0, port=1234)
    assert "--rdzv-endpoint=127.0.0.1:1234" in here and "--local-addr=127.0.0.1" in here
    assert "--rdzv-conf=is_host=1" in here
    assert "--rdzv-conf=is_host=0" in torchrun.command("course_lib.labs.hello", nnodes=2, node_rank=1, port=1234)
    assert real[-2:] == ["-m", "course_lib.labs.hello"]
    # every real node runs the same line: c10d ignores --node-rank, and the defaults need not be spelled out
    assert real == torchrun.command("course_lib.labs.hello", nproc=4, nnodes=2, node_rank=0, port=29400, host="node001")
    assert not any(a.startswith(("--node-rank", "--monitor-interval", "--max-restarts")) for a in real)
    assert "--max-restarts=3" in torchrun.command("m", nnodes=2, max_restarts=3, host="node001")


def test_a_script_runs_as_a_path_and_sees_only_its_nodes_gpus(monkeypatch):
    cmd = torchrun.command("exported/hello_worker.py", nnodes=2, node_rank=1, port=1234)
    assert cmd[-1] == "exported/hello_worker.py" and "-m" not in cmd[3:]
    # a plain script knows only CUDA: its node's share of this machine's GPUs goes in CUDA_VISIBLE_DEVICES,
    # renamed through the GPUs this process itself is allowed to see
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert torchrun._visible("2,3") == "2,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert torchrun._visible("2,3") == "6,7" and torchrun._visible("") == ""


def test_torchrun_lines_shown_to_a_learner_carry_no_path_of_this_machine():
    import sys
    import tempfile

    from course_lib.labs.torchrun import readable

    gloo = ("[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
            "Connection closed by peer [127.0.0.1]:17332.")
    assert readable(gloo) == "[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:17332."
    agent = f"failed (exitcode: -9) local_rank: 0 (pid: 502) of binary: {sys.executable}"
    assert readable(agent) == "failed (exitcode: -9) local_rank: 0 (pid: 502) of binary: python"
    err = f"error_file: {tempfile.gettempdir()}/torchelastic_x/none_y/attempt_0/0/error.json"
    assert readable(err) == "error_file: <temporary file>"
