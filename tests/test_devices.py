"""Backend and device choice, and every refused request, decided before any process starts (no GPU needed)."""

import pytest

import course_lib
from course_lib import LaunchError, plan

ALL = lambda name: True  # noqa: E731  (a torch build with every backend)
GLOO_ONLY = lambda name: name == "gloo"  # noqa: E731


def test_auto_without_gpus_is_gloo_on_cpu():
    p = plan("auto", 4, gpus=0, available=ALL)
    assert p.backend == "gloo" and p.devices == ("cpu",) * 4
    assert "no GPU" in p.reason


def test_auto_with_one_gpu_per_rank_is_nccl():
    p = plan("auto", 4, gpus=8, available=ALL)
    assert p.backend == "nccl"
    assert p.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")


def test_auto_with_too_few_gpus_falls_back_to_gloo():
    p = plan("auto", 4, gpus=2, available=ALL)
    assert p.backend == "gloo" and "2 GPU" in p.reason


def test_auto_with_gpus_but_no_nccl_build_is_gloo():
    p = plan("auto", 2, gpus=2, available=GLOO_ONLY)
    assert p.backend == "gloo" and "no NCCL" in p.reason


def test_nccl_without_gpus_is_refused_with_what_to_do():
    with pytest.raises(LaunchError, match="backend='gloo'"):
        plan("nccl", 2, gpus=0, available=ALL)


def test_more_nccl_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(LaunchError) as err:
        plan("nccl", 4, gpus=2, available=ALL)
    msg = str(err.value)
    assert "4 NCCL ranks" in msg and "2 GPU" in msg and "CUDA_VISIBLE_DEVICES=2,3" in msg
    assert "world_size=2" in msg and "backend='gloo'" in msg


def test_explicit_nccl_uses_visible_gpus_from_zero():
    # A student given GPUs 2,3 through CUDA_VISIBLE_DEVICES sees them as cuda:0 and cuda:1.
    assert plan("nccl", 2, gpus=2, available=ALL).devices == ("cuda:0", "cuda:1")


@pytest.mark.parametrize("backend", ["tcp", "NCCLX", "", None, 3])
def test_unknown_backend_is_refused(backend):
    with pytest.raises(LaunchError, match="Unknown backend"):
        plan(backend, 2, gpus=0, available=ALL)


@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_below_one_is_refused(world_size):
    with pytest.raises(LaunchError, match="at least 1"):
        plan("auto", world_size, gpus=0, available=ALL)


@pytest.mark.parametrize("world_size", [2.5, "4", True, None])
def test_world_size_must_be_a_whole_number(world_size):
    with pytest.raises(LaunchError, match="whole number"):
        plan("auto", world_size, gpus=0, available=ALL)


def test_mpi_missing_is_explained():
    with pytest.raises(LaunchError, match="MPI"):
        plan("mpi", 2, gpus=0, available=GLOO_ONLY)


def test_backend_name_is_case_insensitive():
    assert plan("GLOO", 2, gpus=0, available=ALL).backend == "gloo"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(backend="nccl"),
        dict(backend="unknown"),
        dict(world_size=0),
        dict(timeout=0),
        dict(timeout=-3),
        dict(output="loud"),
    ],
)
def test_run_refuses_before_any_process_starts(monkeypatch, kwargs):
    monkeypatch.setattr(course_lib.runtime.devices, "gpu_count", lambda: 0)

    def no_server():
        raise AssertionError("a process was about to start")

    monkeypatch.setattr(course_lib.runtime.launch, "get_server", no_server)
    with pytest.raises(LaunchError):
        course_lib.run(lambda: None, **{"world_size": 2, **kwargs})


def test_run_refuses_a_non_function(monkeypatch):
    monkeypatch.setattr(course_lib.runtime.launch, "get_server", lambda: pytest.fail("a process was about to start"))
    with pytest.raises(LaunchError, match="needs a function"):
        course_lib.run("print('hi')", 2)


def test_run_refuses_arguments_that_cannot_reach_the_ranks(monkeypatch):
    import threading

    monkeypatch.setattr(course_lib.runtime.launch, "get_server", lambda: pytest.fail("a process was about to start"))
    with pytest.raises(LaunchError, match="Could not send"):
        course_lib.run(lambda lock: None, 2, args=(threading.Lock(),))


def test_plan_keeps_the_gpu_rule_of_lab_gpus(monkeypatch):
    # the rule torchrun workers follow (devices.node_gpus) holds for run() as well: a node's GPUs are LAB_GPUS
    from course_lib.runtime import devices

    monkeypatch.setattr(devices, "gpu_count", lambda: 4)
    monkeypatch.setenv("LAB_GPUS", "2,3")
    p = devices.plan("auto", 2, available=lambda name: True)
    assert p.backend == "nccl" and p.devices == ("cuda:2", "cuda:3")
    assert devices.plan("auto", 3, available=lambda name: True).backend == "gloo"  # 2 GPUs for 3 ranks
    monkeypatch.setenv("LAB_GPUS", "")
    assert devices.plan("auto", 1, available=lambda name: True).backend == "gloo"  # none for this node
