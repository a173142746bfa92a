"""Checkers of the exercises answered by a formula or a command line (notebooks 01, 02, 07, 10, 12, 16, 17): a right
answer passes, a wrong one fails without the expected value in the message, and a library function that holds
the answer is refused while the learner's function runs."""

import math

import pytest

from course_lib import costmodel
from course_lib import hardware as hw
from course_lib.checks import estimates, multi_node
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.sharding import check_per_rank_bytes
from course_lib.checks.training import check_ring_bytes, check_servers_to_match_ring


def test_cards_days_and_seconds():
    def cards():
        st = hw.training_state_bytes(hw.row("training_runs", "LLaMA-65B")["params"], "mixed")
        return hw.gpus_to_hold(st["total"], hw.row("accelerators", "H100 SXM 80GB"))

    assert cards() == 13                                        # 1.0432e12 B / (81559 MiB = 85.5e9 B) = 12.2
    estimates.check_cards_for_llama(cards)
    estimates.check_cards_for_llama(lambda: math.ceil(16 * 65.2e9 / (80 * 2**30)))   # the name's 80 GiB: also 13
    with pytest.raises(ExerciseFailed) as e:
        estimates.check_cards_for_llama(lambda: cards() - 1)    # 12 bytes per parameter, say
    assert str(cards()) not in str(e.value).replace(str(cards() - 1), "") and "Hint" in str(e.value)
    with pytest.raises(ExerciseFailed, match=r"you said 14 cards.*80 GiB"):
        estimates.check_cards_for_llama(lambda: math.ceil(16 * 65.2e9 / 80e9))   # "80GB" read as 80e9 bytes

    b = hw.row("training_runs", "BLOOM-176B")
    days = hw.training_flops(b["params"], b["tokens"]) / (b["gpus"] * b["tflops_per_gpu"] * 1e12) / 86400
    estimates.check_bloom_days(lambda: days)
    with pytest.raises(ExerciseFailed, match=r"you said 0\.9 days"):
        estimates.check_bloom_days(lambda: days / 86400 * 1000)
    seconds = hw.transfer_time_s(2 * hw.row("training_runs", "LLaMA-65B")["params"], "PCIe 4.0 x16")
    estimates.check_gradient_transfer(lambda: seconds)
    with pytest.raises(ExerciseFailed, match=r"Exercise 2\.1: you said"):
        estimates.check_gradient_transfer(lambda: seconds / 2)   # fp16 taken as 1 byte


def _speed_setup(model="LLaMA-7B", link="InfiniBand HDR", seqs_per_gpu=8):
    """notebook 01's speed_setup: compute of a step at LLaMA-65B's achieved rate, fp16 gradients, the link's
    alpha/beta."""
    runs = {r["name"]: r for r in hw.training_runs()}
    rate = hw.flops_per_gpu_from_throughput(runs["LLaMA-65B"]["params"], runs["LLaMA-65B"]["tokens_per_s_per_gpu"])
    m, lk = runs[model], hw.row("links", link)
    step_s = hw.training_flops(m["params"], seqs_per_gpu * m["seq_len"]) / rate
    return step_s, 2 * m["params"], lk["typical_latency_us"] * 1e-6, 1 / (lk["GBps_one_direction"] * 1e9)


def test_gpus_at_a_fixed_global_batch():
    def by_doubling():          # the solution cell's way: data_parallel_speed with 2048 // p sequences per GPU
        p = 1
        while 2 * p <= 2048 and hw.data_parallel_speed(
                2 * p, *_speed_setup("LLaMA-7B", "Ethernet 100 GbE", 2048 // (2 * p)))["speedup_ratio"] >= 0.85:
            p *= 2
        setup = _speed_setup("LLaMA-7B", "Ethernet 100 GbE", 2048 // p)
        return p, setup[0] + hw.data_parallel_speed(p, *setup)["comm_s"]

    def by_scaling():           # written differently: hw.scaling in strong-scaling mode, scanning down from 2048
        seq_s, grads, alpha, beta = _speed_setup("LLaMA-7B", "Ethernet 100 GbE", 1)
        for k in range(11, -1, -1):
            r = hw.scaling(2 ** k, seq_s, grads, alpha, beta, global_batch=2048)
            if r["efficiency"] >= 0.85:
                return 2 ** k, r["step_s"]

    assert by_doubling()[0] == by_scaling()[0] == 64
    estimates.check_gpus_at_fixed_batch(by_doubling, _speed_setup)
    estimates.check_gpus_at_fixed_batch(by_scaling, _speed_setup)
    estimates.check_gpus_at_fixed_batch(lambda: [64, by_scaling()[1] * 1.005], _speed_setup)
    p, step = by_doubling()
    for wrong, why in [((32, step), r"32 GPUs is not the largest"), ((128, step), r"128 GPUs is not the largest"),
                       ((256, step), r"256 GPUs is not the largest"), ((48, step), r"48 GPUs does not split"),
                       ((64.0, step), r"64\.0 GPUs does not split"), ((64, step * 2), r"64 GPUs is right, but"),
                       ((64, _speed_setup("LLaMA-7B", "Ethernet 100 GbE", 32)[0]), r"64 GPUs is right, but"),
                       (64, r"return two numbers")]:
        with pytest.raises(ExerciseFailed, match=why) as e:
            estimates.check_gpus_at_fixed_batch(lambda w=wrong: w, _speed_setup)
        assert f"{step:.1f}" not in str(e.value)


def test_servers_and_bandwidths():
    def fewest():
        k = 1
        while costmodel.ps_vs_allreduce(16, 1, 1, k)["ps_s"] > costmodel.ps_vs_allreduce(16, 1, 1, k)["allreduce_s"]:
            k += 1
        return k

    estimates.check_servers_for_16(fewest)
    with pytest.raises(ExerciseFailed, match=r"with k = 1 the PS"):
        estimates.check_servers_for_16(lambda: 1)
    algbw = (1 << 30) / 10e-3 / 1e9
    estimates.check_all_gather_bandwidths(lambda: (algbw, algbw * 7 / 8))
    with pytest.raises(ExerciseFailed, match=r"does not use all_gather's factor"):
        estimates.check_all_gather_bandwidths(lambda: (algbw, algbw * 2 * 7 / 8))   # all_reduce's factor


def test_ring_and_ps_formulas_refuse_the_library():
    check_servers_to_match_ring(lambda n: max(1, math.ceil(n * n / (2 * (n - 1)) - 1e-9)))
    with pytest.raises(ExerciseFailed, match=r"Exercise 10\.2 is about solving the PS and ring formulas; the course's "
                                             r"own costmodel\.ps_vs_allreduce \(it holds the answer\) is switched"):
        check_servers_to_match_ring(lambda n: next(k for k in range(1, n + 1)
                                                   if costmodel.ps_vs_allreduce(n, 1, 1, k)["ps_s"]
                                                   <= costmodel.ps_vs_allreduce(n, 1, 1, k)["allreduce_s"]))
    with pytest.raises(ExerciseFailed, match=r"costmodel\.allreduce_traffic \(it holds the answer\) is switched off"):
        check_ring_bytes(lambda n, m: costmodel.allreduce_traffic("ring", n, m)["busiest"])


def test_per_rank_bytes_refuses_the_library():
    from course_lib.measure.memory import per_rank_bytes

    with pytest.raises(ExerciseFailed, match=r"^Exercise 12\.1 is about the bytes each ZeRO stage leaves on a rank; "
                                             r"the course's own measure\.memory\.per_rank_bytes \(it holds the "
                                             r"answer\) is switched off here\."):
        check_per_rank_bytes(lambda scheme, shapes, p: per_rank_bytes(scheme, shapes, p))
    assert per_rank_bytes("DP", [(2, 3)], 2)["params"] == 24      # and it works again afterwards


def test_failure_rates():
    llama = next(r for r in hw.load_table("failure_rates") if r["run"].startswith("Llama 3"))
    rate = llama["interruptions_unexpected"] / llama["days"] / llama["accelerators"]
    estimates.check_interruptions_per_day(lambda n: n * rate)
    with pytest.raises(ExerciseFailed, match=r"for 1 GPUs you said"):
        estimates.check_interruptions_per_day(lambda n: llama["interruptions_unexpected"] / llama["days"])
    estimates.check_checkpoint_interval(lambda c, n: math.sqrt(2 * c * 86400 / (n * rate)))
    with pytest.raises(ExerciseFailed, match=r"60 s per save on 16384 GPUs: you said") as e:
        estimates.check_checkpoint_interval(lambda c, n: math.sqrt(2 * c * 24 / (n * rate)))    # MTBF in hours
    assert "16.1" in str(e.value)


def test_torchrun_line_read_by_torchruns_parser():
    def line(nnodes, node_rank, gpus, head, port):
        return (f"torchrun --nnodes {nnodes} --node_rank={node_rank} --nproc-per-node={gpus} --rdzv-backend=c10d "
                f"--rdzv-endpoint={head}:{port} -m course_lib.labs.hello")

    multi_node.check_torchrun_line(line)
    with pytest.raises(ExerciseFailed, match=r"torchrun reads --node-rank as 0"):
        multi_node.check_torchrun_line(lambda *a: line(a[0], 0, *a[2:]))
    with pytest.raises(ExerciseFailed, match=r"torchrun's argument parser refuses it"):
        multi_node.check_torchrun_line(lambda *a: line(*a).replace("--nnodes", "--nodes"))

    def from_the_course(nnodes, node_rank, gpus, head, port):
        from course_lib.labs import torchrun

        return " ".join(torchrun.command("course_lib.labs.hello", nproc=gpus, nnodes=nnodes, node_rank=node_rank))

    with pytest.raises(ExerciseFailed, match=r"labs\.torchrun\.command \(it holds the answer\) is switched off"):
        multi_node.check_torchrun_line(from_the_course)
    multi_node.check_global_rank(lambda node, local, gpus: node * gpus + local)
    with pytest.raises(ExerciseFailed, match=r"node 1, local rank 0, 1 GPUs per node: you said 0"):
        multi_node.check_global_rank(lambda node, local, gpus: local)
