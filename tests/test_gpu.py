"""The CUDA paths, for a machine with GPUs: skipped (and reported as skipped) where there is none, as on CI.

Run on a GPU machine with ``pytest tests/test_gpu.py -v``; one GPU is enough (NCCL with one rank per GPU).
"""

import subprocess
import sys

import pytest
import torch

from course_lib import device, plan, run
from course_lib.runtime.devices import gpu_count

GPUS = gpu_count()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU (this machine has none)")
N = min(GPUS, 4)


def _nccl_all_reduce():
    import torch.distributed as dist

    t = torch.full((1000,), float(dist.get_rank() + 1), device=device())
    dist.all_reduce(t)
    return dist.get_backend(), str(t.device), torch.cuda.current_device(), t


def test_auto_picks_nccl_with_one_gpu_per_rank():
    p = plan("auto", N)
    assert p.backend == "nccl" and p.devices == tuple(f"cuda:{r}" for r in range(N))


def test_nccl_ranks_use_their_own_gpu_and_results_come_back_on_cpu():
    res = run(_nccl_all_reduce, N, backend="nccl", timeout=120, output="none")
    for rank, (backend, where, current, t) in enumerate(res.values):
        assert backend == "nccl" and where == f"cuda:{rank}" and current == rank
        assert t.device.type == "cpu" and torch.all(t == N * (N + 1) / 2)


def test_launching_still_works_after_cuda_is_initialised_in_the_kernel():
    torch.zeros(1, device="cuda")  # the kernel touches CUDA first, as a learner's cell would
    assert torch.cuda.is_initialized()
    res = run(_nccl_all_reduce, N, timeout=120, output="none")
    assert all(torch.all(v[3] == N * (N + 1) / 2) for v in res.values)


def test_interactive_ranks_on_gpus_after_cuda_is_initialised_in_the_kernel():
    from course_lib.runtime.interactive import Ranks

    torch.zeros(1, device="cuda")  # as a learner's cell would, before %ranks start
    with Ranks(N, backend="nccl", timeout=60) as group:
        group.run_cell("t = torch.ones(3, device=device) * (rank + 1)\ndist.all_reduce(t)", show=False)
        values = group.pull("t")
    assert all(torch.all(v == N * (N + 1) / 2) for v in values)


def _large_on_gpu(mb):
    import torch.distributed as dist

    return torch.full((mb * 2**20 // 4,), float(dist.get_rank() + 1), device=device())


def test_a_large_gpu_result_comes_back_on_the_cpu():
    res = run(_large_on_gpu, N, args=(64,), timeout=120, output="none")
    for rank, t in enumerate(res.values):
        assert t.device.type == "cpu" and t.shape == (16 * 2**20,)
        assert torch.equal(t[:: 2**16], torch.full((256,), rank + 1.0))  # a copy: exact


def _tutorial_nccl(port):
    import os

    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port  # the PyTorch tutorial's own setup
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t


def test_a_learners_own_nccl_rendezvous_works_under_init_false():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    res = run(_tutorial_nccl, N, args=(port,), init=False, backend="nccl", timeout=120, output="none")
    assert all(torch.equal(v, torch.full((4,), N * (N + 1) / 2)) for v in res.values)


def test_doctor_lists_the_gpus_and_passes_its_nccl_smoke_test():
    done = subprocess.run([sys.executable, "-m", "course_lib", "doctor", "--ranks", str(N), "--backend", "nccl"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cuda:0" in done.stdout and "smoke test    OK" in done.stdout
    assert "bf16 yes" in done.stdout or "bf16 no" in done.stdout
    assert f"NCCL lessons: {'up to ' + str(GPUS) + ' ranks' if GPUS >= 2 else '1 rank only'}" in done.stdout


def test_gpu_copy_ceilings_are_measured():
    from course_lib.bench.ceilings import measure_ceilings

    got = measure_ceilings(0.2)
    assert got["h2d_GBps"] and got["d2h_GBps"] and got["d2d_GBps"]


def test_zero_stages_and_fsdp2_on_nccl_end_with_single_process_adam_weights():
    from course_lib.measure.memory import per_rank_bytes
    from course_lib.training.adam import train_single_adam
    from course_lib.training.tolerance import adam_atol, max_diff
    from course_lib.training.zero import held_by_fsdp2, run_schemes

    out = run_schemes(N, steps=3, batch_size=16, hidden=32, timeout=300)               # float32: the bytes
    for scheme, ranks in out.items():
        for r, v in enumerate(ranks):
            want = held_by_fsdp2(v["shapes"], N, r) if scheme == "FSDP2" else per_rank_bytes(scheme, v["shapes"], N)
            assert v["memory"] == want, f"{scheme} rank {r}"     # torch's Adam keeps no state for FSDP2's padding
    # the weights in float64 (GPU kernels vs the CPU reference: float32 through Adam would bound nothing)
    exact = run_schemes(N, steps=3, batch_size=16, hidden=32, dtype=torch.float64, comm_log=False, timeout=300)
    ref, _ = train_single_adam(N, 3, 16, hidden=32, dtype=torch.float64)
    for scheme, ranks in exact.items():
        for r, v in enumerate(ranks):
            assert max_diff(v["params"], ref) <= adam_atol(3, 1e-3, N * 16, 32), f"{scheme} rank {r} on cuda:{r}"


@pytest.mark.parametrize("impl", ["ours", "dtensor"])
def test_tensor_parallel_on_nccl_equals_single_process_sgd(impl):
    from course_lib.training import train_single
    from course_lib.training.tensor_parallel import launch_tp_train
    from course_lib.training.tolerance import max_diff, sgd_atol

    ref, _ = train_single(n_workers=1, steps=3, batch_size=16, hidden=48)   # 48: divisible by 1-4 GPUs
    for r, v in enumerate(launch_tp_train(N, timeout=300, steps=3, batch=16, hidden=48, impl=impl)):
        assert max_diff(v["params"], ref) <= sgd_atol(3, 0.1, 16, 48), f"rank {r} on cuda:{r}"


def test_two_torchrun_nodes_on_this_machine_use_their_own_gpus_or_gloo():
    # Two one-worker "nodes" on one machine: each on a GPU of its own when there are two, gloo with one (both on
    # cuda:0 NCCL says "Duplicate GPU detected").
    from course_lib.labs import torchrun as tr

    nodes = tr.run_nodes("course_lib.labs.hello", nnodes=2, nproc=1, timeout=180)
    assert all(n.returncode == 0 for n in nodes), "\n".join(n.output[-3000:] for n in nodes)
    text = "".join(n.output for n in nodes)
    if GPUS >= 2:
        assert text.count("backend nccl") == 2 and "device cuda:0" in text and "device cuda:1" in text
    else:
        assert text.count("backend gloo") == 2


def _pipeline_on_gpus(data):
    from course_lib.training import pipeline as pl

    return {name: pl.pipeline_train(name, steps=3, m=4, data=data) for name in pl.SCHEDULES}


@pytest.mark.skipif(GPUS < 2, reason="a pipeline needs two GPUs, one stage each")
def test_pipeline_schedules_on_nccl_equal_single_process_sgd():
    from course_lib.training import pipeline as pl
    from course_lib.training.data import load_digits
    from course_lib.training.tolerance import max_diff, sgd_atol

    want = pl.stage_params(pl.train_reference(3)[0], N)
    vals = run(_pipeline_on_gpus, N, args=(load_digits(),), backend="nccl", timeout=300, output="none").values
    for s, v in enumerate(vals):
        for name, r in v.items():
            # float32 sums in another order (micro-batches, another device's kernels): training.tolerance
            assert max_diff(r["params"], want[s]) <= sgd_atol(3, 0.1, 32, 256), f"{name} stage {s} on cuda:{s}"


def _tokens(rank, d=8):
    return torch.randn(20 + 5 * rank, d, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64)


def _moe_on_gpus(experts):
    import torch.distributed as dist

    from course_lib.training.moe import MoE, ep_forward

    layer = MoE(k=2, capacity_factor=1.25, n_experts=experts).to(device())
    return ep_forward(_tokens(dist.get_rank()).to(device()), layer)


def test_expert_parallel_all_to_all_on_nccl_equals_the_layer():
    from course_lib.training.moe import MoE
    from course_lib.training.tolerance import max_diff, sum_atol

    experts = 2 * N
    layer = MoE(k=2, capacity_factor=1.25, n_experts=experts)
    res = run(_moe_on_gpus, N, args=(experts,), backend="nccl", timeout=120, output="none")
    for r, y in enumerate(res.values):
        # float64 sums of <= 8 + 16 products of size < 10, in another order on another device
        assert max_diff(y, layer(_tokens(r))) < sum_atol(24, 240.0, torch.float64), f"rank {r} on cuda:{r}"


def _qkv(s=24, d=4):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(s, d, generator=g, dtype=torch.float64) for _ in range(3)]


def _ring_on_gpus(causal, layout):
    import torch.distributed as dist

    from course_lib.training.ring_attention import positions, ring_attention

    rows = positions(dist.get_rank(), dist.get_world_size(), 24, layout)
    q, k, v = (t[rows].to(device()) for t in _qkv())
    return ring_attention(q, k, v, causal, layout, True)


@pytest.mark.skipif(GPUS < 2, reason="a ring needs two GPUs")
@pytest.mark.parametrize("causal, layout", [(False, "contiguous"), (True, "zigzag")])
def test_ring_attention_on_nccl_equals_full_attention(causal, layout):
    from course_lib.training.ring_attention import attention, positions
    from course_lib.training.tolerance import max_diff, sum_atol

    p = 3 if N >= 3 else 2                                  # 24 rows: blocks of 8 or 12, zig-zag chunks of 4 or 6
    full = attention(*_qkv(), causal)
    res = run(_ring_on_gpus, p, args=(causal, layout), backend="nccl", timeout=120, output="none")
    for r, o in enumerate(res.values):
        assert max_diff(o, full[positions(r, p, 24, layout)]) < sum_atol(48, 10.0, torch.float64), f"rank {r}"


@pytest.mark.skipif(GPUS < 4, reason="a 2 x 2 mesh needs four GPUs")
def test_fsdp_x_tp_and_hsdp_on_a_gpu_mesh_train_to_single_process_sgd():
    from course_lib.training import train_single
    from course_lib.training.mesh import mesh_train
    from course_lib.training.tolerance import max_diff, sgd_atol

    res = run(lambda: [mesh_train("fsdp_tp"), mesh_train("hsdp")], 4, backend="nccl", timeout=300, output="none")
    for i, workers in enumerate((2, 4)):
        ref, _ = train_single(workers, 5, 16, lr=0.1, hidden=64, dtype=torch.float64)
        for rank, v in enumerate(res.values):
            assert max_diff(v[i]["params"], ref) < sgd_atol(5, 0.1, 16 * workers, 64, torch.float64), rank


def _gossip_and_rings_on_gpus(batched):
    """What the NCCL-rules mode found: a ring of unbatched irecv-then-isend hangs on NCCL; the course's fixes."""
    import torch.distributed as dist

    from course_lib.collectives import ring_all_reduce
    from course_lib.training.gossip import gossip_round

    r, p = dist.get_rank(), dist.get_world_size()
    x = torch.full((6,), float(r), device=device())
    got = torch.empty_like(x)
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, (r - 1) % p),
                                        dist.P2POp(dist.isend, x, (r + 1) % p)])
    else:
        works = [dist.irecv(got, (r - 1) % p), dist.isend(x, (r + 1) % p)]
    for w in works:
        w.wait()
    if not batched:
        return got
    g = gossip_round(x.clone(), "ring")
    s = ring_all_reduce(torch.arange(7.0, device=device()) * (r + 1))
    return got, g, s


@pytest.mark.skipif(GPUS < 3, reason="a ring that can form a cycle needs three GPUs")
def test_the_gossip_ring_and_the_course_ring_run_on_nccl_and_the_unbatched_ring_hangs():
    from course_lib.runtime.results import RankFailed

    p = min(GPUS, 4)
    vals = run(_gossip_and_rings_on_gpus, p, args=(True,), backend="nccl", timeout=120, output="none").values
    from course_lib.training.gossip import in_neighbours

    for r, (got, g, s) in enumerate(vals):
        assert torch.equal(got, torch.full((6,), float((r - 1) % p)))
        srcs = in_neighbours("ring", p, r)  # gossip keeps an equal share of itself and of each in-neighbour
        want = (r + sum(srcs)) / (len(srcs) + 1)
        assert torch.allclose(g, torch.full((6,), float(want)))  # a few small whole numbers: rounding only
        assert torch.equal(s, torch.arange(7.0) * p * (p + 1) / 2)  # whole numbers: exact in any order
    # the pattern the mode refuses on gloo: NCCL serialises it on the group's stream and it never completes
    with pytest.raises(RankFailed):
        run(_gossip_and_rings_on_gpus, p, args=(False,), backend="nccl", timeout=20, output="none")


AVERAGE_GRADIENTS = """
def average_gradients(model, batch_size):
    total = torch.tensor([float(batch_size)], device=next(model.parameters()).device)
    dist.all_reduce(total)
    for p in model.parameters():
        p.grad *= batch_size
        dist.all_reduce(p.grad)
        p.grad /= total
"""


@pytest.mark.skipif(GPUS < 2, reason="the checker runs 2 and more ranks: NCCL needs a GPU per rank")
def test_exercise_9_1_checker_passes_on_nccl():
    import torch.distributed as dist

    from course_lib.checks.training import check_average_gradients
    from tests.conftest import notebook_function

    # its ranks put the model on their GPU: a checker whose model stayed on the CPU would fail every solution on NCCL
    check_average_gradients(notebook_function(AVERAGE_GRADIENTS, "average_gradients", torch=torch, dist=dist))
