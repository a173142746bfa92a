"""run(): values, output, environment and repeated launches, with functions defined the way a notebook defines them;
requests refused before any process starts; what a rank gets from the kernel (and what it must not)."""

import gc
import socket
import subprocess
import sys

import pytest
import torch

import course_lib
from course_lib import LaunchError, RankFailed, run
from tests.conftest import notebook_function
from tests.gpu_plan import simulated_gpus_fixture  # noqa: F401  (registers the fixture "simulated_gpus")

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TUTORIAL = notebook_function(
    """
    import os, torch, torch.distributed as dist

    def init_process(rank, size, fn, backend="gloo", port="29500"):
        # The PyTorch tutorial's setup ("Writing Distributed Applications with PyTorch"), unchanged but for the port.
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = port
        dist.init_process_group(backend, rank=rank, world_size=size)
        return fn(rank, size)

    def total(rank, size):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return t.item()

    def tutorial(port):
        return init_process(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), total, port=port)

    def by_tcp(port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        return total(dist.get_rank(), dist.get_world_size())
    """,
    "tutorial",
)


def test_a_learners_own_rendezvous_works_under_init_false():
    # A fixed port of the learner's choosing (free here, so that parallel test runs do not collide): rank 0 hosts
    # the store on it, exactly as torch does without a launcher. The 10 s timeout is far below a hang's 60 s.
    assert run(TUTORIAL, 2, args=(str(_free_port()),), init=False, timeout=10, output="none").values == [3.0, 3.0]
    by_tcp = TUTORIAL.__globals__["by_tcp"]
    assert run(by_tcp, 3, args=(_free_port(),), init=False, timeout=10, output="none").values == [6.0] * 3


def test_the_env_store_outlives_rank_0s_function():
    # Rank 0 hosts the store; it returns at once while rank 1 still has to read it (notebook 03 uses it by hand).
    fn = notebook_function(
        """
        import os, time
        from datetime import timedelta
        import torch.distributed as dist
        def late_reader():
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=10))
            if os.environ["RANK"] == "0":
                store.set("lesson/k", "written by rank 0")
                return None
            time.sleep(0.5)
            return store.get("lesson/k").decode()
        """,
        "late_reader",
    )
    assert run(fn, 2, init=False, timeout=10, output="none").values == [None, "written by rank 0"]


def _no_server(monkeypatch):
    monkeypatch.setattr(course_lib.runtime.launch, "get_server", lambda *a: pytest.fail("a process was about to start"))


def test_the_tutorials_rank_and_size_arguments_are_refused_in_one_sentence(monkeypatch):
    _no_server(monkeypatch)
    f = notebook_function("def run_fn(rank, size):\n    return rank\n", "run_fn")
    with pytest.raises(LaunchError) as err:
        run(f, 2)
    text = str(err.value)
    assert text.startswith("run() calls run_fn() on every rank, with no rank or world size added, and "
                           "run_fn(rank, size) cannot be called that way (missing a required argument: 'rank')")
    assert "dist.get_rank() and dist.get_world_size()" in text and text.count(". ") == 0  # one sentence
    with pytest.raises(LaunchError, match=r"calls <lambda>\(1, 2\) on every rank.*too many positional arguments"):
        run(lambda x: x, 2, args=(1, 2))


def test_a_world_size_beyond_the_machine_is_refused_with_the_figures(monkeypatch):
    from course_lib.runtime import machine_limits

    _no_server(monkeypatch)
    monkeypatch.setattr(machine_limits, "available_memory", lambda: 8 * 2**30)
    monkeypatch.setattr(machine_limits, "open_files_limit", lambda: 1024)
    with pytest.raises(LaunchError) as err:
        run(ALLREDUCE, 1000)
    text = str(err.value)
    assert "world_size=1000 is more than this machine can hold" in text
    assert "125.0 GiB of memory" in text and "8.0 GiB is available" in text  # 1000 x 128 MiB
    assert "3064 open files in this kernel" in text and "may open 1024" in text  # 64 + 3 per rank
    assert "Use at most 64 ranks" in text and "oversubscribe=True" in text  # 8 GiB / 128 MiB
    from course_lib.runtime.interactive import Ranks

    with pytest.raises(LaunchError, match="more than this machine can hold"):
        Ranks(1000)


def test_oversubscribe_starts_what_the_check_would_refuse(monkeypatch):
    from course_lib.runtime import machine_limits

    monkeypatch.setattr(machine_limits, "available_memory", lambda: 2 * machine_limits.RANK_MEMORY_BYTES)
    with pytest.raises(LaunchError, match="Use at most 2 ranks"):
        run(ALLREDUCE, 3, output="none")
    assert run(ALLREDUCE, 3, output="none", oversubscribe=True).values == [6.0] * 3


def test_native_windows_is_refused_with_wsl2(monkeypatch):
    _no_server(monkeypatch)
    monkeypatch.setattr(course_lib.runtime.machine_limits.sys, "platform", "win32")
    for start in (lambda: run(ALLREDUCE, 2), lambda: course_lib.runtime.interactive.Ranks(2)):
        with pytest.raises(LaunchError, match="Linux or macOS, or on Windows inside WSL2"):
            start()


LARGE = notebook_function(
    """
    import torch, torch.distributed as dist
    def large(mb):
        return torch.full((mb * 2**20 // 4,), float(dist.get_rank() + 1))
    """,
    "large",
)


def test_two_ranks_return_200_mb_each():
    # Within a 60 s launch: reading results in 64 KiB appends took 199 s for one such result.
    res = run(LARGE, 2, args=(200,), timeout=60, output="none")
    for r, t in enumerate(res.values):
        assert t.shape == (50 * 2**20,) and t.is_contiguous()
        assert torch.equal(t[:: 2**16], torch.full((800,), r + 1.0)) and t[-1].item() == r + 1.0  # copies: exact


def test_results_keep_dtype_shape_and_odd_tensors():
    fn = notebook_function(
        """
        import torch
        def odd():
            base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
            return {"view": base.T, "bf16": torch.ones(3, dtype=torch.bfloat16), "empty": torch.empty(0, 2),
                    "scalar": torch.tensor(7), "grad": torch.ones(2, requires_grad=True) * 1,
                    "module": torch.nn.Linear(2, 1), "conj": torch.tensor([1 + 2j]).conj()}
        """,
        "odd",
    )
    v = run(fn, 1, output="none").values[0]
    assert torch.equal(v["view"], torch.arange(12, dtype=torch.float64).reshape(3, 4).T)
    assert v["bf16"].dtype == torch.bfloat16 and v["empty"].shape == (0, 2) and v["scalar"].item() == 7
    assert isinstance(v["module"].weight, torch.nn.Parameter) and v["module"].weight.requires_grad  # torch's way
    assert torch.equal(v["conj"], torch.tensor([1 - 2j]))
    assert not v["grad"].requires_grad  # run() detaches what a rank returns


def test_the_kernels_cuda_state_never_reaches_a_rank(simulated_gpus, cuda_initialised_in_kernel):
    # Two simulated GPUs: "auto" picks NCCL, one GPU per rank. init=False keeps NCCL itself out of a CPU machine;
    # the ranks still get their devices, and torch.cuda in each is as fresh as in a new process.
    simulated_gpus(2)
    fn = notebook_function(
        """
        import os, torch
        from course_lib import device
        def where():
            return str(device()), os.environ["LOCAL_RANK"], torch.cuda._initialized
        """,
        "where",
    )
    res = run(fn, 2, init=False, output="none")
    assert res.backend == "nccl" and res.values == [("cuda:0", "0", False), ("cuda:1", "1", False)]


def test_the_rank_server_preloads_dynamo_only_for_kernels_that_will_use_it():
    from course_lib.runtime.rank_process import rank_preloads

    code = "from course_lib.runtime.rank_process import rank_preloads; print(rank_preloads())"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert plain.stdout.strip() == "()", plain.stderr  # a kernel that uses none of them starts its server fast
    optim = subprocess.run([sys.executable, "-c", "import torch; torch.optim.SGD([torch.zeros(1, requires_grad=True)]"
                            ", lr=0.1); " + code], capture_output=True, text=True, timeout=60)
    assert optim.stdout.strip() == "('torch._dynamo',)", optim.stderr  # an optimizer imported torch._dynamo here
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCalls(TorchDispatchMode):  # a learner's own dispatch mode, with torch's dynamo guard
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert rank_preloads() == ("torch._dynamo",)
    del CountCalls
    gc.collect()
    quiet = ("from torch.utils._python_dispatch import TorchDispatchMode\n"   # opts out, as the course's own modes do
             "class Quiet(TorchDispatchMode):\n"
             "    @classmethod\n    def _should_skip_dynamo(cls):\n        return False\n" + code)
    opted_out = subprocess.run([sys.executable, "-c", quiet], capture_output=True, text=True, timeout=60)
    assert opted_out.stdout.strip() == "()", opted_out.stderr


IMPORTED = notebook_function(
    """
    import sys
    def imported(name):
        return name in sys.modules
    """,
    "imported",
)


def test_the_rank_server_imports_the_library_modules_a_launch_sends_by_name():
    """A checker launches a function of its own module, with library functions as arguments: cloudpickle sends them
    by name, so the rank server imports their modules once rather than every rank at every launch."""
    from course_lib.checks import basics, core
    from course_lib.runtime.rank_process import library_modules

    args = ("Exercise 0.1", ALLREDUCE, basics._torch_max, basics.rank_values, [core.Case(2, 1, torch.float32)])
    assert library_modules(core._cases, args, {}) == ("course_lib.checks.core", "course_lib.checks.basics")
    assert library_modules(ALLREDUCE, (torch.ones(1), 3), {"f": print}) == ()   # the notebook's own: by value
    got = run(basics.rank_values, 2, args=(1, 2, 5, torch.int64), output="none").values
    assert all(torch.equal(g, basics.rank_values(1, 2, 5, torch.int64)) for g in got)
    # a notebook function that imports nothing finds the module in every rank: the server had imported it
    assert run(IMPORTED, 2, args=("course_lib.checks.basics",), output="none").values == [True, True]
