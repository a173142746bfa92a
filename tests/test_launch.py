"""run(): values, output, environment and repeated launches, with functions defined the way a notebook defines them."""

import itertools
import linecache
import textwrap

import pytest
import torch

import course_lib
from course_lib import LaunchError, RankFailed, run

_CELLS = itertools.count(1)


def notebook_function(src: str, name: str, **globals_):
    """Define a function in a fake __main__, as a notebook cell does (cloudpickle must send it by value)."""
    src = textwrap.dedent(src)
    filename = f"<notebook cell {next(_CELLS)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # as IPython does for cells
    ns = {"__name__": "__main__", **globals_}
    exec(compile(src, filename, "exec"), ns)
    return ns[name]


ALLREDUCE = notebook_function(
    """
    import torch, torch.distributed as dist
    def allreduce_rank():
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"I am rank {dist.get_rank()} of {dist.get_world_size()}")
        return t.item()
    """,
    "allreduce_rank",
)


def test_every_rank_runs_and_returns_in_rank_order():
    res = run(ALLREDUCE, 4, output="none")
    assert res.values == [10.0] * 4
    assert res.backend == "gloo" and res.devices == ("cpu",) * 4
    assert [s.strip() for s in res.stdout] == [f"I am rank {r} of 4" for r in range(4)]
    assert all(t["fn_s"] >= 0 and t["init_s"] >= 0 for t in res.times)


def test_world_size_one_works():
    assert run(ALLREDUCE, 1, output="none").values == [1.0]


def test_live_output_is_tagged_by_rank(capfd):
    run(ALLREDUCE, 3, output="live")
    out = capfd.readouterr().out
    for r in range(3):
        assert f"[rank {r}] I am rank {r} of 3" in out


def test_grouped_output_comes_in_rank_order(capfd):
    run(ALLREDUCE, 4, output="grouped")
    lines = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("[rank")]
    assert lines == [f"[rank {r}] I am rank {r} of 4" for r in range(4)]


def test_fd_level_output_reaches_the_cell_tagged(capfd):
    # What C++ code (gloo, NCCL) writes goes straight to fd 1/2, past Python's sys.stdout.
    fn = notebook_function(
        """
        import os
        def raw():
            os.write(1, b"fd one\\n")
            os.write(2, b"fd two, no newline")
            print("python", flush=True)
        """,
        "raw",
    )
    res = run(fn, 2)
    captured = capfd.readouterr()
    assert "[rank 1] fd one" in captured.out and "[rank 0] python" in captured.out
    assert "[rank 0] fd two, no newline" in captured.err
    assert res.stderr[1] == "fd two, no newline\n"


def test_closure_lambda_args_and_kwargs():
    scale = 3.0
    fn = notebook_function(
        """
        import torch.distributed as dist
        def make(offset):
            return lambda x, *, y: (dist.get_rank() + offset) * x * y * scale
        """,
        "make",
        scale=scale,
    )
    res = run(fn(10), 2, args=(2,), kwargs={"y": 0.5}, output="none")
    assert res.values == [10 * 2 * 0.5 * scale, 11 * 2 * 0.5 * scale]


def test_tensors_come_back():
    fn = notebook_function(
        """
        import torch, torch.distributed as dist
        def chunk():
            return {"t": torch.arange(3) + dist.get_rank(), "l": [torch.ones(2)]}
        """,
        "chunk",
    )
    res = run(fn, 2, output="none")
    assert torch.equal(res[1]["t"], torch.tensor([1, 2, 3]))
    assert torch.equal(res[0]["l"][0], torch.ones(2))


def test_standard_environment_is_set():
    fn = notebook_function(
        """
        import os, torch.distributed as dist
        def env():
            return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
        """,
        "env",
    )
    res = run(fn, 3, output="none")
    for r, env in enumerate(res.values):
        assert env == {"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1"}


def test_learner_may_initialise_the_group_with_env_init(monkeypatch):
    fn = notebook_function(
        """
        import torch, torch.distributed as dist
        def own_init():
            assert not dist.is_initialized()
            dist.init_process_group("gloo")           # env://, as under torchrun
            t = torch.ones(1)
            dist.all_reduce(t)
            dist.destroy_process_group()
            return t.item()
        """,
        "own_init",
    )
    assert run(fn, 3, init=False, output="none").values == [3.0] * 3


def test_kernel_environment_changes_reach_the_ranks(monkeypatch):
    # The fork server started earlier; a variable set in the kernel now must still reach the ranks.
    monkeypatch.setenv("COURSE_TEST_VALUE", "fresh")
    fn = notebook_function("import os\ndef v():\n    return os.environ.get('COURSE_TEST_VALUE')\n", "v")
    assert run(fn, 2, output="none").values == ["fresh", "fresh"]


def test_the_same_function_ten_times_in_one_kernel():
    for _ in range(10):
        assert run(ALLREDUCE, 2, output="none").values == [3.0, 3.0]


def test_twenty_launches_in_a_row_just_work():
    for i in range(20):
        n = 2 + i % 3
        assert run(ALLREDUCE, n, output="none").values == [n * (n + 1) / 2] * n


def test_a_value_that_cannot_travel_back_is_explained():
    fn = notebook_function("import threading\ndef bad():\n    return threading.Lock()\n", "bad")
    with pytest.raises(RankFailed, match="cannot be sent back"):
        run(fn, 2, output="none")


def test_result_displays_in_a_notebook():
    res = run(ALLREDUCE, 2, output="none")
    html = res._repr_html_()
    assert "<table>" in html and "<code>gloo</code>" in html and "<code>3.0</code>" in html
    assert "rank 1 [cpu] -> 3.0" in repr(res)


def test_device_outside_a_launch_is_cpu():
    assert course_lib.device() == torch.device("cpu")


def test_bad_timeout_type_refused():
    with pytest.raises(LaunchError, match="timeout"):
        run(ALLREDUCE, 2, timeout="10")
