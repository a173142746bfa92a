"""CommLog sees every collective, from our calls and from torch's own wrappers, with nccl-tests sizes and ring bytes."""

import pytest
import torch
import torch.distributed as dist

from course_lib import run
from course_lib.measure.comm_log import Call, CommLog


def _calls():
    import torch.distributed._functional_collectives as fc
    pair = dist.new_group([0, 1])
    t = torch.ones(4)                                         # 16 bytes
    with CommLog() as log:
        dist.all_reduce(t)
        if dist.get_rank() < 2:
            dist.all_reduce(t, group=pair)
        fc.all_reduce(t, "sum", group=dist.group.WORLD) * 1
        dist.broadcast(t, 0)
        dist.all_gather([torch.empty(4) for _ in range(3)], t)
        out = torch.empty(12)
        dist.all_gather_single(out, t)
        dist.reduce_scatter_single(torch.empty(4), out)
        dist.reduce_scatter(torch.empty(4), [torch.ones(4)] * 3)
    return [(c.op, c.size, c.p) for c in log.calls], log.summary()


@pytest.fixture(scope="module")
def logged():
    return run(_calls, world_size=3, output="none", timeout=60).values


def test_every_collective_is_seen_with_its_size_and_group(logged):
    assert logged[0][0] == [("all_reduce", 16, 3), ("all_reduce", 16, 2), ("all_reduce", 16, 3),
                            ("broadcast", 16, 3), ("all_gather", 48, 3), ("all_gather", 48, 3),
                            ("reduce_scatter", 48, 3), ("reduce_scatter", 48, 3)]
    assert ("all_reduce", 16, 2) not in logged[2][0]          # rank 2 is not in the pair's group


def test_summary_totals_ring_bytes(logged):
    s = logged[0][1]
    assert s["all_reduce"]["calls"] == 3 and s["all_reduce"]["bytes"] == 48
    assert s["all_reduce"]["ring_bytes"] == pytest.approx(2 * 2 / 3 * 16 * 2 + 2 * 1 / 2 * 16)
    assert s["total"]["calls"] == 8


def test_ring_bytes_formula():
    assert Call("all_reduce", 300, 3).ring_bytes == 400
    assert Call("all_gather", 300, 3).ring_bytes == 200 == Call("reduce_scatter", 300, 3).ring_bytes
    assert Call("all_reduce", 300, 1).ring_bytes == 0


def test_the_rank_server_preloads_dynamo_only_for_kernels_that_count_collectives():
    import subprocess
    import sys
    code = "import sys{}; from course_lib.runtime.rank_process import rank_preloads; print(rank_preloads())"
    plain = subprocess.run([sys.executable, "-c", code.format("")], capture_output=True, text=True, timeout=120)
    counting = subprocess.run([sys.executable, "-c", code.format(", course_lib.measure.comm_log")],
                              capture_output=True, text=True, timeout=120)
    assert plain.stdout.strip() == "()", plain.stderr
    assert counting.stdout.strip() == "('torch._dynamo',)", counting.stderr
