"""Notebook 01's checkers (course_lib.checks.walls): each refuses (a) the library shortcut, (b) a wrong method that
gives the right number in one case, (c) a plausible wrong result, without the expected value in its message, and accepts
(d) a right answer written differently."""

import math

import numpy as np
import pytest
import torch

from course_lib.checks import walls
from course_lib.checks.core import ExerciseFailed
from course_lib.costs import alpha_beta
from course_lib.costs import hardware as hw

H100 = hw.row("accelerators", "H100 SXM 80GB")


def _largest():                                      # the bytes of eight cards over 16 bytes per parameter
    return 8 * hw.memory_bytes(H100) / hw.training_state_bytes(1, "mixed")["total"]


def test_largest_model_accepts_any_real_capacity_and_any_number_type():
    walls.check_largest_model_on_a_server(_largest)
    walls.check_largest_model_on_a_server(lambda: int(8 * 80 * 2**30 // 16))    # the name's 80 GiB, floored
    walls.check_largest_model_on_a_server(lambda: 8 * 81106 * 2**20 / 16)        # what CUDA reports (deviceQuery)
    walls.check_largest_model_on_a_server(lambda: 8 * 85.5e9 / 16)              # nvidia-smi's total, rounded
    for kind in (np.int64, np.float32, np.float64):                              # numpy's numbers
        walls.check_largest_model_on_a_server(lambda k=kind: k(_largest()))
    walls.check_largest_model_on_a_server(lambda: torch.tensor(_largest(), dtype=torch.float64))   # a 0-d tensor
    walls.check_largest_model_on_a_server(lambda: np.array(_largest()))                           # a 0-d array


def test_largest_model_refuses_wrong_capacities_and_counts():
    h200 = hw.row("accelerators", "H200 SXM 141GB")
    for wrong in (lambda: 8 * 80e9 / 16,                     # "80GB" read as 80e9 bytes (6.4% short)
                  lambda: 8 * hw.memory_bytes(H100) / 12,    # 12 bytes per parameter
                  lambda: 8 * hw.memory_bytes(H100) / 18,    # Megatron's 18 (fp32 main gradients): another recipe
                  lambda: 8 * hw.memory_bytes(h200) / 16,    # the wrong card
                  lambda: hw.memory_bytes(H100) / 16,        # one card, not eight
                  lambda: _largest() / 1e9):                 # billions, not parameters
        with pytest.raises(ExerciseFailed) as e:
            walls.check_largest_model_on_a_server(wrong)
        assert f"{_largest():.4g}" not in str(e.value) and "Hint" in str(e.value)
    for not_a_number in (lambda: "42.8e9", lambda: [_largest()], lambda: True, lambda: torch.ones(2)):
        with pytest.raises(ExerciseFailed, match=r"return the number of parameters as a number"):
            walls.check_largest_model_on_a_server(not_a_number)
    with pytest.raises(ExerciseFailed, match=r"starting ranks or processes"):   # no answer from ranks of one's own
        walls.check_largest_model_on_a_server(
            lambda: __import__("course_lib.runtime.launch").runtime.launch.run(print, 2))


def test_bloom_mfu():
    b = hw.row("training_runs", "BLOOM-176B")
    flops = hw.training_flops(b["params"], b["tokens"])
    mfu = flops / (b["gpu_hours"] * 3600) / 312e12
    assert 0.30 < mfu < 0.33                               # ~99 TFLOP/s averaged, against 150 measured while running
    walls.check_bloom_mfu(lambda: mfu)
    walls.check_bloom_mfu(lambda: 6 * b["params"] * b["tokens"] / 3600 / b["gpu_hours"] / 312 / 1e12)
    walls.check_bloom_mfu(lambda: 6 * 176e9 * b["tokens"] / (b["gpu_hours"] * 3600) / 312e12)    # rounded N
    walls.check_bloom_mfu(lambda: np.float32(mfu))
    for wrong in (lambda: b["tflops_per_gpu"] / 312,            # the measured rate, not the run's average
                  lambda: b["tflops_per_gpu"] * 6 / 8 / 312,    # its model-FLOP rate while training, not the average
                  lambda: 8 * b["params"] * b["tokens"] / (b["gpu_hours"] * 3600) / 312e12,   # recomputation counted
                  lambda: flops / (b["gpu_hours"] * 60) / 312e12,   # hours taken as minutes
                  lambda: flops / 3 / (b["gpu_hours"] * 3600) / 312e12,   # 2·N·D, the forward pass only
                  lambda: flops / (b["gpu_hours"] * 3600) / 19.5e12,      # the fp32 peak
                  lambda: 100 * mfu):                                      # a percentage
        with pytest.raises(ExerciseFailed, match=r"Exercise 1\.2: you said"):
            walls.check_bloom_mfu(wrong)


RUNS = {r["name"]: r for r in hw.training_runs()}
RATE = hw.flops_per_gpu_from_throughput(RUNS["LLaMA-65B"]["params"], RUNS["LLaMA-65B"]["tokens_per_s_per_gpu"])


def _speed_setup(model="LLaMA-7B", link="InfiniBand HDR", seqs_per_gpu=8, busbw_GBps=None):
    """notebook 01's speed_setup: compute of a step at LLaMA-65B's achieved rate, fp16 gradients, the link's alpha and
    its one-direction rate as the all-reduce's bandwidth unless a measured bus bandwidth is given."""
    m, lk = RUNS[model], hw.row("links", link)
    step_s = hw.training_flops(m["params"], seqs_per_gpu * m["seq_len"]) / RATE
    GBps = busbw_GBps or lk["GBps_one_direction"]
    return step_s, 2 * m["params"], lk["typical_latency_us"] * 1e-6, 1 / (GBps * 1e9)


def by_doubling(link="Ethernet 100 GbE", min_ratio=0.85):   # the solution cell's way
    def ratio_and_step(p):
        setup = _speed_setup("LLaMA-7B", link, 2048 // p)
        r = hw.data_parallel_speed(p, *setup)
        return r["speedup_ratio"], setup[0] + r["comm_s"]

    p = 1
    while 2 * p <= 2048 and ratio_and_step(2 * p)[0] >= min_ratio:
        p *= 2
    return p, ratio_and_step(p)[1]


def _scan(link, min_ratio, ratio_of, comm_of):
    """Scan p down from 2048 with the given ratio and all-reduce formulas: the shape of (b)'s wrong methods."""
    seq_s, grads, alpha, beta = _speed_setup("LLaMA-7B", link, 1)
    for k in range(11, -1, -1):
        p = 2 ** k
        compute = 2048 // p * seq_s
        comm = comm_of(p, grads, alpha, beta) if p > 1 else 0.0
        if ratio_of(compute, comm) >= min_ratio:
            return p, compute + comm
    return 1, 2048 * seq_s


def by_hand(link="Ethernet 100 GbE", min_ratio=0.85):       # (d) written differently: the ring written out
    return _scan(link, min_ratio, lambda c, m: c / (c + m),
                 lambda p, n, a, b: 2 * (p - 1) * a + 2 * (p - 1) / p * n * b)


def test_the_key_and_right_answers_written_differently():
    p, step = by_doubling()
    assert (p, round(step, 1)) == (64, 19.8)                          # the instructor guide's key
    assert [by_doubling(*c)[0] for c in walls.CASES] == [64, 1024, 2]
    for link, r in walls.CASES:
        assert by_hand(link, r)[0] == by_doubling(link, r)[0]
        assert math.isclose(by_hand(link, r)[1], by_doubling(link, r)[1], rel_tol=1e-12)
    walls.check_gpus_at_fixed_batch(by_doubling, _speed_setup)
    walls.check_gpus_at_fixed_batch(by_hand, _speed_setup)
    walls.check_gpus_at_fixed_batch(                                   # alpha_beta's ring, float shares of the batch
        lambda link, r: _scan(link, r, lambda c, m: c / (c + m), alpha_beta.ring_allreduce), _speed_setup)
    walls.check_gpus_at_fixed_batch(                                   # the ring's bandwidth term only, no alpha
        lambda link, r: _scan(link, r, lambda c, m: c / (c + m), lambda p, n, a, b: 2 * (p - 1) / p * n * b),
        _speed_setup)
    walls.check_gpus_at_fixed_batch(lambda link, r: [by_doubling(link, r)[0], by_doubling(link, r)[1] * 1.005],
                                    _speed_setup)
    walls.check_gpus_at_fixed_batch(lambda link, r: (np.int64(by_doubling(link, r)[0]),
                                                     np.float64(by_doubling(link, r)[1])), _speed_setup)
    walls.check_gpus_at_fixed_batch(lambda link, r: (float(by_doubling(link, r)[0]), by_doubling(link, r)[1]),
                                    _speed_setup)
    walls.check_gpus_at_fixed_batch(lambda link, r: tuple(torch.tensor(x) for x in by_doubling(link, r)),
                                    _speed_setup)


def test_gpus_at_fixed_batch_refuses_the_shortcut_wrong_methods_and_wrong_results():
    step = by_doubling()[1]

    def by_scaling(link, min_ratio):      # (a) the library's strong-scaling mode splits the global batch itself
        seq_s, grads, alpha, beta = _speed_setup("LLaMA-7B", link, 1)
        for k in range(11, -1, -1):
            r = hw.scaling(2 ** k, seq_s, grads, alpha, beta, global_batch=2048)
            if r["efficiency"] >= min_ratio:
                return 2 ** k, r["step_s"]

    scaling = hw.scaling

    def by_an_alias(link, min_ratio):     # (a) the same function under another name, taken before the check
        seq_s, grads, alpha, beta = _speed_setup("LLaMA-7B", link, 1)
        return 64, scaling(64, seq_s, grads, alpha, beta, global_batch=2048)["step_s"]

    for shortcut in (by_scaling, by_an_alias):
        with pytest.raises(ExerciseFailed, match=r"costs\.hardware\.scaling \(it holds the answer\) is switched off") \
                as e:
            walls.check_gpus_at_fixed_batch(shortcut, _speed_setup)
        assert "data_parallel_speed" in str(e.value) and f"{step:.1f}" not in str(e.value)

    # (b) right at 100 GbE and 0.85, wrong elsewhere: a constant, 1 - comm/compute, 2·n·beta without (p-1)/p
    wrong_methods = {
        "the key as a constant": (lambda link, r: (64, step), r"Ethernet 400 GbE at a ratio of 0\.6: 64 GPUs"),
        "1 - comm/compute": (lambda link, r: _scan(link, r, lambda c, m: 1 - m / c, alpha_beta.ring_allreduce),
                             r"Ethernet 400 GbE at a ratio of 0\.6: 512 GPUs is not the largest"),
        "2·n·beta": (lambda link, r: _scan(link, r, lambda c, m: c / (c + m),
                                           lambda p, n, a, b: 2 * (p - 1) * a + 2 * n * b),
                     r"Ethernet 25 GbE at a ratio of 0\.99: 1 GPUs is not the largest"),
    }
    for name, (method, why) in wrong_methods.items():
        assert method("Ethernet 100 GbE", 0.85)[0] == 64, name             # right on the statement's example
        with pytest.raises(ExerciseFailed, match=why):
            walls.check_gpus_at_fixed_batch(method, _speed_setup)

    def weak(link, min_ratio):            # (c) a fixed 8 sequences per GPU: the global batch grows
        p = 1
        while 2 * p <= 2048 and hw.data_parallel_speed(2 * p, *_speed_setup("LLaMA-7B", link, 8))["speedup_ratio"] \
                >= min_ratio:
            p *= 2
        return p, _speed_setup("LLaMA-7B", link, 8)[0]

    with pytest.raises(ExerciseFailed, match=r"Ethernet 100 GbE at a ratio of 0\.85: 1 GPUs is not the largest"):
        walls.check_gpus_at_fixed_batch(weak, _speed_setup)
    no_comm = _speed_setup("LLaMA-7B", "Ethernet 100 GbE", 32)[0]
    for wrong, why in [((32, step), r"32 GPUs is not the largest"), ((128, step), r"128 GPUs is not the largest"),
                       ((48, step), r"48 GPUs does not split"), ((64.5, step), r"64\.5 GPUs does not split"),
                       ((64, step * 2), r"64 GPUs is right, but"), ((64, no_comm), r"64 GPUs is right, but"),
                       ((64, "about 20 s"), r"return the seconds per step as a number"),
                       (64, r"return two numbers")]:
        with pytest.raises(ExerciseFailed, match=why) as e:
            walls.check_gpus_at_fixed_batch(lambda link, r, w=wrong: w, _speed_setup)
        assert f"{step:.1f}" not in str(e.value)
    # (c) the table's link (InfiniBand HDR) instead of the one asked for
    with pytest.raises(ExerciseFailed, match=r"Ethernet 100 GbE at a ratio of 0\.85: 128 GPUs is not the largest"):
        walls.check_gpus_at_fixed_batch(lambda link, r: by_doubling("InfiniBand HDR", r), _speed_setup)
