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


def test_counting_collectives_keeps_the_rank_server_fast():
    # CommLog opts out of torch's dynamo guard: using it imports no torch._dynamo (seconds per rank), so a kernel
    # that counts collectives needs no preload of it either
    import subprocess
    import sys
    code = "import sys{}; from course_lib.runtime.rank_process import rank_preloads; print(rank_preloads())"
    plain = subprocess.run([sys.executable, "-c", code.format("")], capture_output=True, text=True, timeout=120)
    counting = subprocess.run([sys.executable, "-c", code.format(", course_lib.measure.comm_log")],
                              capture_output=True, text=True, timeout=120)
    assert plain.stdout.strip() == "()", plain.stderr
    assert counting.stdout.strip() == "()", counting.stderr
    used = subprocess.run([sys.executable, "-c", "import sys, torch; from course_lib.measure.comm_log import CommLog\n"
                           "with CommLog(): torch.ones(2) + 1\nprint('torch._dynamo' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert used.stdout.strip() == "False", used.stderr


def _more_calls():
    t = torch.ones(4)                                         # 16 bytes per rank
    with CommLog() as log:
        dist.all_reduce_coalesced([t, torch.ones(2)])          # 24 bytes in one call
        dist.gather(t, [torch.empty(4) for _ in range(3)] if dist.get_rank() == 0 else None, dst=0)
        dist.scatter(torch.empty(4), [torch.ones(4)] * 3 if dist.get_rank() == 0 else None, src=0)
        dist.all_to_all([torch.empty(4) for _ in range(3)], [torch.ones(4)] * 3)
        dist.all_gather_coalesced([[torch.empty(4)] for _ in range(3)], [t])
        if dist.get_rank() == 0:
            dist.send(t, 1)                                   # point-to-point: not a collective, not recorded
        elif dist.get_rank() == 1:
            dist.recv(torch.empty(4), 0)
        dist.barrier()                                        # moves no data: not recorded
    return [(c.op, c.size, c.p) for c in log.calls]


def test_gather_scatter_coalesced_and_list_all_to_all_are_recorded_with_nccl_tests_sizes():
    got = run(_more_calls, world_size=3, output="none", timeout=60).values
    # the gather's result and the scatter's input are 3 x 16 bytes; the list all-to-all sends 3 x 16
    assert got[0] == got[2] == [("all_reduce", 24, 3), ("gather", 48, 3), ("scatter", 48, 3),
                                ("all_to_all", 48, 3), ("all_gather", 48, 3)]


def test_every_c10d_operator_and_collective_of_torch_distributed_is_in_the_one_table():
    # measure/c10d_ops.py is the course's only table of c10d operators (issue 27): every dispatcher operator torch
    # registers for c10d and functional collectives, and every communicating function of torch.distributed, is in it
    # or named in NOT_RECORDED with the reason
    import torch.distributed._functional_collectives  # noqa: F401  (the modules that register operators)
    import torch.distributed.tensor  # noqa: F401

    from course_lib.measure.c10d_ops import COLLECTIVES, NOT_RECORDED, OP_TO_COLLECTIVE

    ops = {n.split(".")[0].replace("::", ".") for n in torch._C._dispatch_get_all_op_names()
           if n.split("::")[0] in ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "symm_mem")}
    assert len(ops) > 30
    missing = [op for op in ops if op not in OP_TO_COLLECTIVE and op not in NOT_RECORDED
               and op.split(".")[0] not in NOT_RECORDED]
    assert sorted(missing) == []
    named = {n for names, _ in COLLECTIVES.values() for n in names}
    import inspect
    import warnings

    with warnings.catch_warnings():  # dist.reduce_op, deprecated, warns when looked at
        warnings.simplefilter("ignore", FutureWarning)
        public = {n for n, f in vars(dist.distributed_c10d).items() if inspect.isfunction(f) and not n.startswith("_")
                  and f.__module__ == dist.distributed_c10d.__name__}
    not_communication = {n for n in public if n.startswith(("get_", "is_", "new_", "init_", "destroy_", "supports_"))
                         } | {"shrink_group", "split_group", "record_comm"}
    communicating = {n for n in public if n in dir(dist)} - not_communication
    assert len(communicating) > 25
    assert sorted(communicating - named - set(NOT_RECORDED)) == []


def _one_recording():
    from course_lib.checks.watch import Watch, summary
    from course_lib.measure.alltoall_log import AllToAllLog, exchanges_of
    from course_lib.measure.comm_log import calls_of

    r, p = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)                                         # 16 bytes
    with CommLog() as alone, AllToAllLog() as exchanges, Watch() as w:
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(12), t)
        # rank r sends j + 1 rows of 8 bytes to rank j, so it receives r + 1 rows from each
        dist.all_to_all_single(torch.empty(3 * (r + 1), 2), torch.ones(6, 2), [r + 1] * 3, [1, 2, 3])
        for work in (dist.isend(t, (r + 1) % p), dist.irecv(torch.empty(4), (r - 1) % p)):
            work.wait()
    mine = exchanges_of(w.events)                             # the views, read off the events Watch recorded
    return {"calls": [(c.op, c.size, c.p) for c in calls_of(w.events)],
            "alone": [(c.op, c.size, c.p) for c in alone.calls],
            "a2a": [(e.to, e.frm, e.via, e.sent) for e in mine],
            "sent": (sum(e.sent for e in mine), exchanges.sent), "received": (sum(e.received for e in mine),
                                                                              exchanges.received),
            "a2a_alone": [(e.to, e.frm, e.via, e.sent) for e in exchanges.calls], "summary": summary(w.record())}


def test_one_recording_gives_commlogs_sizes_alltoall_bytes_and_watchs_messages():
    # recorder.py is the one dispatch mode: CommLog, AllToAllLog and Watch read the same events, so a block recorded
    # once by Watch gives the other two's figures, equal to what each records on its own
    for r, v in enumerate(run(_one_recording, world_size=3, output="none", timeout=60).values):
        s_a2a = 3 * (r + 1) * 8                               # S of an all-to-all: its output, as nccl-tests
        assert v["calls"] == v["alone"] == [("all_reduce", 16, 3), ("all_gather", 48, 3), ("all_to_all", s_a2a, 3)]
        assert v["a2a"] == v["a2a_alone"] == [([8, 16, 24], [8 * (r + 1)] * 3, "c10d", 48 - 8 * (r + 1))]
        assert v["sent"] == (48 - 8 * (r + 1),) * 2 and v["received"] == (16 * (r + 1),) * 2
        s = v["summary"]
        assert (s["messages_sent"], s["bytes_sent"], s["messages_recv"], s["bytes_recv"]) == (1, 16, 1, 16)
        assert (s["sent_to"], s["recv_from"]) == ([(r + 1) % 3], [(r - 1) % 3])
        assert s["collectives"] == {"all_reduce": 1, "all_gather_single": 1, "all_to_all": 1}


def _counted_calls():
    from course_lib.measure.collective_calls import counted

    t = torch.ones(4)
    with counted() as calls:
        dist.all_reduce(t)
        dist.reduce_scatter_single(torch.empty(4), torch.ones(12))
        dist.all_gather([torch.empty(4) for _ in range(3)], t)
    return [(c.op, c.numel, c.nbytes) for c in calls]


def test_counted_measures_each_call_by_its_largest_tensor_argument_in_elements_and_bytes_alike():
    # collective_calls.counted (notebook 11b): a reduce-scatter by its input (S, as nccl-tests counts it), a list
    # all-gather by its outputs together; elements and bytes read the same tensors (float32: 4 bytes each)
    for calls in run(_counted_calls, world_size=3, output="none", timeout=60).values:
        assert calls == [("all_reduce", 4, 16), ("reduce_scatter_single", 12, 48), ("all_gather", 12, 48)]
