"""Checkers of the exercises answered by a formula or a command line (notebooks 01, 07, 10, 12, 16, 17; notebook
02's are in test_checks_cluster.py): a right answer passes, a wrong one fails without the expected value in the
message, and a library function that holds the answer is refused while the learner's function runs."""

import math

import numpy as np
import pytest
import torch

from course_lib.checks import estimates, multi_node
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.training import check_ring_bytes, check_servers_to_match_ring
from course_lib.costs import alpha_beta
from course_lib.costs import hardware as hw


def test_largest_model_mfu_and_seconds():
    h100 = hw.row("accelerators", "H100 SXM 80GB")

    def largest():                                      # the bytes of eight cards over 16 bytes per parameter
        return 8 * hw.memory_bytes(h100) / hw.training_state_bytes(1, "mixed")["total"]

    estimates.check_largest_model_on_a_server(largest)
    estimates.check_largest_model_on_a_server(lambda: int(8 * 80 * 2**30 // 16))    # the name's 80 GiB, floored
    for wrong in (lambda: 8 * 80e9 / 16,                     # "80GB" read as 80e9 bytes
                  lambda: 8 * hw.memory_bytes(h100) / 12,    # 12 bytes per parameter
                  lambda: hw.memory_bytes(h100) / 16):       # one card, not eight
        with pytest.raises(ExerciseFailed) as e:
            estimates.check_largest_model_on_a_server(wrong)
        assert f"{largest():.4g}" not in str(e.value) and "Hint" in str(e.value)
    with pytest.raises(ExerciseFailed, match=r"starting ranks or processes"):   # no answer from ranks of one's own
        estimates.check_largest_model_on_a_server(
            lambda: __import__("course_lib.runtime.launch").runtime.launch.run(print, 2))

    b = hw.row("training_runs", "BLOOM-176B")
    flops = hw.training_flops(b["params"], b["tokens"])
    mfu = flops / (b["gpu_hours"] * 3600) / 312e12
    assert 0.30 < mfu < 0.33                               # ~99 TFLOP/s averaged, against 150 measured while running
    estimates.check_bloom_mfu(lambda: mfu)
    estimates.check_bloom_mfu(lambda: 6 * b["params"] * b["tokens"] / 3600 / b["gpu_hours"] / 312 / 1e12)
    for wrong in (lambda: b["tflops_per_gpu"] / 312,            # the measured rate, not the run's average
                  lambda: b["tflops_per_gpu"] * 6 / 8 / 312,    # its model-FLOP rate while training, not the average
                  lambda: 8 * b["params"] * b["tokens"] / (b["gpu_hours"] * 3600) / 312e12,   # recomputation counted
                  lambda: flops / (b["gpu_hours"] * 60) / 312e12,   # hours taken as minutes
                  lambda: flops / 3 / (b["gpu_hours"] * 3600) / 312e12):   # 2·N·D, the forward pass only
        with pytest.raises(ExerciseFailed, match=r"Exercise 1\.2: you said"):
            estimates.check_bloom_mfu(wrong)


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

    def by_hand():              # (d) written differently: the ring's cost written out, scanning down from 2048
        seq_s, grads, alpha, beta = _speed_setup("LLaMA-7B", "Ethernet 100 GbE", 1)
        for k in range(11, -1, -1):
            p = 2 ** k
            compute = 2048 // p * seq_s
            comm = 2 * (p - 1) * alpha + 2 * (p - 1) / p * grads * beta
            if compute / (compute + comm) >= 0.85:
                return p, compute + comm

    def by_scaling():           # (a) the library's strong-scaling mode splits the global batch itself
        seq_s, grads, alpha, beta = _speed_setup("LLaMA-7B", "Ethernet 100 GbE", 1)
        for k in range(11, -1, -1):
            r = hw.scaling(2 ** k, seq_s, grads, alpha, beta, global_batch=2048)
            if r["efficiency"] >= 0.85:
                return 2 ** k, r["step_s"]

    def weak():                 # (c) a fixed 8 sequences per GPU: the global batch grows, the ratio never reaches 0.85
        p = 1
        while 2 * p <= 2048 and hw.data_parallel_speed(
                2 * p, *_speed_setup("LLaMA-7B", "Ethernet 100 GbE", 8))["speedup_ratio"] >= 0.85:
            p *= 2
        return p, _speed_setup("LLaMA-7B", "Ethernet 100 GbE", 8)[0]

    p, step = by_doubling()
    assert p == by_hand()[0] == 64 and math.isclose(step, by_hand()[1], rel_tol=1e-12)
    def ratio(q):
        return hw.data_parallel_speed(q, *_speed_setup("LLaMA-7B", "Ethernet 100 GbE", 2048 // q))["speedup_ratio"]

    assert round(ratio(64), 2) == 0.89 and round(ratio(128), 2) == 0.81     # the guide's key
    assert round(step, 1) == 19.8
    estimates.check_gpus_at_fixed_batch(by_doubling, _speed_setup)
    estimates.check_gpus_at_fixed_batch(by_hand, _speed_setup)
    estimates.check_gpus_at_fixed_batch(lambda: [64, step * 1.005], _speed_setup)
    estimates.check_gpus_at_fixed_batch(lambda: (np.int64(64), np.float64(step)), _speed_setup)   # numpy's numbers
    estimates.check_gpus_at_fixed_batch(lambda: (64.0, step), _speed_setup)                        # a whole float
    with pytest.raises(ExerciseFailed, match=r"costs\.hardware\.scaling \(it holds the answer\) is switched off") as e:
        estimates.check_gpus_at_fixed_batch(by_scaling, _speed_setup)
    assert "data_parallel_speed" in str(e.value) and f"{step:.1f}" not in str(e.value)
    with pytest.raises(ExerciseFailed, match=r"1 GPUs is not the largest"):
        estimates.check_gpus_at_fixed_batch(weak, _speed_setup)
    for wrong, why in [((32, step), r"32 GPUs is not the largest"), ((128, step), r"128 GPUs is not the largest"),
                       ((256, step), r"256 GPUs is not the largest"), ((48, step), r"48 GPUs does not split"),
                       ((64.5, step), r"64\.5 GPUs does not split"), ((64, step * 2), r"64 GPUs is right, but"),
                       ((64, _speed_setup("LLaMA-7B", "Ethernet 100 GbE", 32)[0]), r"64 GPUs is right, but"),
                       (64, r"return two numbers")]:
        with pytest.raises(ExerciseFailed, match=why) as e:
            estimates.check_gpus_at_fixed_batch(lambda w=wrong: w, _speed_setup)
        assert f"{step:.1f}" not in str(e.value)


def test_all_gather_bandwidths():
    algbw = (1 << 30) / 10e-3 / 1e9
    estimates.check_all_gather_bandwidths(lambda: (algbw, algbw * 7 / 8))
    with pytest.raises(ExerciseFailed, match=r"does not use all_gather's factor"):
        estimates.check_all_gather_bandwidths(lambda: (algbw, algbw * 2 * 7 / 8))   # all_reduce's factor
    from course_lib.bench.collectives import FACTORS

    with pytest.raises(ExerciseFailed, match=r"FACTORS\.all_gather \(it holds the answer\) is switched off"):
        estimates.check_all_gather_bandwidths(lambda: (algbw, algbw * FACTORS["all_gather"](8)))


def test_all_gather_bandwidths_accepts_an_array_or_a_tensor_of_two(capsys):
    import numpy as np
    import torch

    algbw = (1 << 30) / 10e-3 / 1e9
    estimates.check_all_gather_bandwidths(lambda: np.array([algbw, algbw * 7 / 8]))
    estimates.check_all_gather_bandwidths(lambda: torch.tensor([algbw, algbw * 7 / 8], dtype=torch.float64))
    estimates.check_all_gather_bandwidths(lambda: (107.4, 94.0))          # rounded to one decimal, as printed
    estimates.check_all_gather_bandwidths(lambda: (107, 94))              # rounded to whole GB/s
    assert capsys.readouterr().out.count("✓ Exercise 7.1 passed") == 4
    with pytest.raises(ExerciseFailed, match=r"is not S/t"):
        estimates.check_all_gather_bandwidths(lambda: (100.0, 87.5))          # GiB for GB
    with pytest.raises(ExerciseFailed, match=r"return two numbers"):
        estimates.check_all_gather_bandwidths(lambda: np.array([algbw, algbw * 7 / 8, 0.0]))


def _cpu_machines_closed_form(n, ratio):
    """ratio >= n^2 / (n^2 + k(n-2)), solved for k."""
    if ratio >= 1:
        return 0
    if n == 2 or ratio < n / (2 * (n - 1)) - 1e-12:
        return None
    return min(n, max(0, math.ceil(n * n * (1 - ratio) / (ratio * (n - 2)) - 1e-9)))


def _cpu_machines_by_search(n, ratio):
    ring = 2 * (n - 1) / n
    return next((k for k in range(n + 1) if 2 * n * (n - 1) / (n * n + k * n - 2 * k) <= ratio * ring * (1 + 1e-12)),
                None)


def test_cpu_machines_for_byteps():
    check_servers_to_match_ring(_cpu_machines_closed_form)
    check_servers_to_match_ring(_cpu_machines_by_search)
    with pytest.raises(ExerciseFailed, match=r"n=2 GPU machines, at most 1 x the ring's time: you said 2"):
        check_servers_to_match_ring(lambda n, ratio: max(1, math.ceil(n * n / (2 * (n - 1)) * ratio - 1e-9)))
    with pytest.raises(ExerciseFailed, match=r"Exercise 10\.2 is about solving BytePS's formula for k; the course's "
                                             r"own costs\.alpha_beta\.byteps_optimal \(it holds the answer\)"):
        check_servers_to_match_ring(lambda n, r: next((k for k in range(n + 1) if alpha_beta.byteps_optimal(n, 1, 1, k)
                                                       <= r * 2 * (n - 1) / n), None))


def test_ring_bytes_refuses_the_library_and_running_it():
    with pytest.raises(ExerciseFailed, match=r"alpha_beta\.allreduce_traffic \(it holds the answer\) is switched off"):
        check_ring_bytes(lambda n, m: alpha_beta.allreduce_traffic("ring", n, m)["busiest"])
    with pytest.raises(ExerciseFailed, match=r"alpha_beta\.ring_reduce_scatter \(it holds the answer\)"):
        check_ring_bytes(lambda n, m: alpha_beta.ring_reduce_scatter(n, m, 0, 1)
                         + alpha_beta.ring_all_gather(n, m, 0, 1))
    from course_lib.bench.collectives import FACTORS
    from course_lib.costs import parallel_plan

    for shortcut in (lambda n, m: alpha_beta.ps_vs_allreduce(n, m, 1.0)["allreduce_s"],
                     lambda n, m: alpha_beta.byteps_optimal(n, m, 1.0, 0),
                     lambda n, m: FACTORS["all_reduce"](n) * m,
                     lambda n, m: parallel_plan.ring_all_reduce_s(m, n, 1e-9),
                     lambda n, m: 2 * alpha_beta.lg(n) / alpha_beta.tree_over_ring_ratio(n) * m):
        with pytest.raises(ExerciseFailed, match=r"\(it holds the answer\)"):
            check_ring_bytes(shortcut)
    with pytest.raises(ExerciseFailed, match=r"alpha_beta\.rabenseifner_allreduce \(it holds the answer\)"):
        check_ring_bytes(lambda n, m: alpha_beta.rabenseifner_allreduce(n, m, 0, 1))
    with pytest.raises(ExerciseFailed, match=r"comm_log\.Call\.ring_bytes\.fget \(it holds the answer\)"):
        check_ring_bytes(lambda n, m: __import__("course_lib.measure.comm_log", fromlist=["Call"])
                         .Call("all_reduce", m, n).ring_bytes)
    with pytest.raises(ExerciseFailed, match=r"course's own launch\.run \(it holds the answer\)"):
        check_ring_bytes(_ring_bytes_by_running)


def _ring_bytes_by_running(n, m):
    from course_lib import run
    from course_lib.collectives import Traffic, ring_all_reduce

    def count():
        import torch

        t = Traffic()
        ring_all_reduce(torch.ones(m // 4), traffic=t)
        return t.bytes_sent
    return run(count, world_size=n, output="none").values[0]


def test_ring_bytes_needs_more_than_the_measured_sizes():
    table = {2: 2 * 1 / 2, 3: 2 * 2 / 3, 4: 2 * 3 / 4}        # right on the sizes that are run, and no further
    with pytest.raises(ExerciseFailed, match=r"n=5, M=\d+: you said"):
        check_ring_bytes(lambda n, m: table.get(n, 1.0) * m)
    check_ring_bytes(lambda n, m: (m - m / n) * 2)


def _ring_rows(rows):
    return [r for r in rows if r["op"] == "ring"]


def _sweep():
    return hw.load_table("bench_collectives_2core")


def _lstsq(rows, weighted=True, p=None, dtype=None):
    """torch's least squares on the ring's equations; weighted: each divided by its own t (relative errors)."""
    import torch

    dtype = dtype or torch.float64
    ring = _ring_rows(rows)
    p = p or ring[0]["ranks"]
    t = torch.tensor([r["time_us"] * 1e-6 for r in ring], dtype=dtype)
    a = torch.tensor([[2 * (p - 1), 2 * (p - 1) / p * r["size_bytes"]] for r in ring], dtype=dtype)
    if weighted:
        a, t = a / t[:, None], torch.ones_like(t)
    x = torch.linalg.lstsq(a, t[:, None]).solution
    return x[0], x[1]                                        # one-element tensors: accepted as numbers


def _normal_equations_in_microseconds(rows):
    """Written differently: the line t = a + b S in microseconds by 2x2 normal equations weighted 1/t^2, then
    alpha = a / 2(p-1), beta = b p / 2(p-1)."""
    ring = _ring_rows(rows)
    p = ring[0]["ranks"]
    s00 = s01 = s11 = y0 = y1 = 0.0
    for r in ring:
        w, x, t = 1 / r["time_us"] ** 2, r["size_bytes"], r["time_us"]
        s00, s01, s11, y0, y1 = s00 + w, s01 + w * x, s11 + w * x * x, y0 + w * t, y1 + w * x * t
    det = s00 * s11 - s01 * s01
    a, b = (y0 * s11 - y1 * s01) / det * 1e-6, (s00 * y1 - s01 * y0) / det * 1e-6
    return a / (2 * (p - 1)), b * p / (2 * (p - 1))


def test_course_ring_fit_accepts_a_weighted_least_squares_however_written(capsys):
    rows = _sweep()
    estimates.check_course_ring_fit(_lstsq, rows)
    estimates.check_course_ring_fit(_normal_equations_in_microseconds, rows)
    estimates.check_course_ring_fit(lambda rs: torch.stack(_lstsq(rs)), rows)            # lstsq's 2 x 1 solution
    estimates.check_course_ring_fit(lambda rs: torch.stack(_lstsq(rs)).flatten().numpy(), rows)   # an array
    assert capsys.readouterr().out.count("✓ Exercise 7.2 passed") == 4


@pytest.mark.parametrize("name", ["fit_alpha_beta", "fit_line", "fit_pieces", "_relative_lsq"])
def test_course_ring_fit_refuses_the_course_fits(name):
    rows = _sweep()
    calls = {
        "fit_alpha_beta": lambda rs: alpha_beta.fit_alpha_beta([r["size_bytes"] for r in _ring_rows(rs)],
                                                              [r["time_us"] / 1e6 for r in _ring_rows(rs)], p=4),
        "fit_line": lambda rs: alpha_beta.fit_line([r["size_bytes"] for r in _ring_rows(rs)],
                                                   [r["time_us"] / 1e6 for r in _ring_rows(rs)]),
        "fit_pieces": lambda rs: alpha_beta.fit_pieces([r["size_bytes"] for r in _ring_rows(rs)],
                                                       [r["time_us"] / 1e6 for r in _ring_rows(rs)], tol=1.0)[0][
                                                           "beta"],
        "_relative_lsq": lambda rs: alpha_beta._relative_lsq([(6, 1.5 * r["size_bytes"]) for r in _ring_rows(rs)],
                                                             [r["time_us"] / 1e6 for r in _ring_rows(rs)]),
    }
    with pytest.raises(ExerciseFailed, match=r"Exercise 7\.2 is about fitting alpha and beta by least squares; the "
                                             r"course's own costs\.alpha_beta\.\w+ \(it holds the answer\)"):
        estimates.check_course_ring_fit(calls[name], rows)
    assert alpha_beta.fit_line([1, 2], [1, 2]) == pytest.approx((0.0, 1.0))           # and it works again afterwards


def test_course_ring_fit_refuses_wrong_methods_and_results():
    rows = _sweep()
    # a wrong method with right-looking numbers: least squares on the times themselves (about 1.2 ms, 0.28 GB/s)
    with pytest.raises(ExerciseFailed, match=r"on the measured sweep your alpha .* the best fit misses by 26%") as e:
        estimates.check_course_ring_fit(lambda rs: _lstsq(rs, weighted=False), rows)
    assert "Hint:" in str(e.value)
    # right on this sweep, wrong on the other: p = 4 written in, this machine's numbers typed in
    with pytest.raises(ExerciseFailed, match=r"on another machine's sweep \(3 ranks\) your alpha"):
        estimates.check_course_ring_fit(lambda rs: _lstsq(rs, p=4), rows)
    fixed = tuple(float(v) for v in _lstsq(rows))
    with pytest.raises(ExerciseFailed, match=r"on another machine's sweep \(3 ranks\) your alpha"):
        estimates.check_course_ring_fit(lambda _: fixed, rows)
    # the wrong rows: gloo's all_reduce instead of the course's ring
    with pytest.raises(ExerciseFailed, match=r"on the measured sweep your alpha"):
        estimates.check_course_ring_fit(lambda rs: _lstsq([dict(r, op="ring") for r in rs if r["op"] == "all_reduce"]),
                                        rows)
    with pytest.raises(ExerciseFailed, match=r"not \(alpha, beta\)"):
        estimates.check_course_ring_fit(lambda rs: (True, 1e-9), rows)


def test_course_ring_fit_names_float32_when_alpha_is_dropped():
    """Float32 lstsq cuts the alpha column (about 1e-9 of S's) as rank-deficient; the failure says so."""
    import torch

    with pytest.raises(ExerciseFailed, match=r"is about zero: was the least squares solved in float32"):
        estimates.check_course_ring_fit(lambda rs: _lstsq(rs, dtype=torch.float32), _sweep())


def test_failure_rates():
    llama = next(r for r in hw.load_table("failure_rates") if r["run"].startswith("Llama 3"))
    rate = llama["interruptions_unexpected"] / llama["days"] / llama["accelerators"]
    estimates.check_interruptions_per_day(lambda n: n * rate)
    with pytest.raises(ExerciseFailed, match=r"for 1 GPUs you said"):
        estimates.check_interruptions_per_day(lambda n: llama["interruptions_unexpected"] / llama["days"])


def _llama_rate(column="interruptions_unexpected"):
    llama = next(r for r in hw.load_table("failure_rates") if r["run"].startswith("Llama 3"))
    return llama[column] / llama["days"] / llama["accelerators"]


def _max_save_closed_form(n, r, w, rate=None, day=86400, lost_per_failure=0.5):
    """The loss at Young's interval solved for C: sqrt(2C/M) + R/M = w. lost_per_failure = 1 (a whole interval
    redone, wrong) gives T = sqrt(CM) and a loss of 2 sqrt(C/M) instead."""
    m = day / (n * (rate or _llama_rate()))
    left = max(w - r / m, 0)
    return left**2 * m / 2 if lost_per_failure == 0.5 else left**2 * m / 4


def _max_save_by_bisection(n, r, w):
    """Another way to the same number: search C with Young's interval and the loss written out, nothing simplified."""
    m = 86400 / (n * _llama_rate())
    if r / m >= w:  # the loss tends to R/M as C goes to 0: no save is short enough
        return 0
    loss = lambda c: c / math.sqrt(2 * c * m) + math.sqrt(2 * c * m) / (2 * m) + r / m  # noqa: E731
    lo, hi = 0.0, m
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if loss(mid) <= w else (lo, mid)
    return lo


def test_max_save_accepts_the_closed_form_and_a_search_and_refuses_wrong_models():
    estimates.check_max_save_s(_max_save_closed_form)
    estimates.check_max_save_s(_max_save_by_bisection)                 # (d) a correct solution written differently
    wrong = {
        "restarts left out": lambda n, r, w: _max_save_closed_form(n, 0, w),
        "M in hours": lambda n, r, w: _max_save_closed_form(n, r, w, day=24),
        "all 466 interruptions, planned ones too": lambda n, r, w: _max_save_closed_form(
            n, r, w, rate=_llama_rate("interruptions_total")),
        "a whole interval lost per failure": lambda n, r, w: _max_save_closed_form(n, r, w, lost_per_failure=1),
        "Young's interval itself, not the save": lambda n, r, w: math.sqrt(2 * 60 * 86400 / (n * _llama_rate())),
    }
    for why, fn in wrong.items():
        with pytest.raises(ExerciseFailed, match=r"Exercise 16\.2: .* you said") as e:
            estimates.check_max_save_s(fn)
        assert "16.1" in str(e.value), why

    def spent(n, r, w):                                                # do the restarts alone use up w?
        return r * n * _llama_rate() / 86400 >= w

    def unclamped(n, r, w):                                            # squares away a budget already spent
        m = 86400 / (n * _llama_rate())
        return (w - r / m) ** 2 * m / 2

    with pytest.raises(ExerciseFailed, match=r"100000 GPUs, 600 s per restart"):
        estimates.check_max_save_s(unclamped)
    with pytest.raises(ExerciseFailed, match=r"less than no time"):
        estimates.check_max_save_s(lambda n, r, w: -1.0 if spent(n, r, w) else _max_save_closed_form(n, r, w))


def test_torchrun_line_read_by_torchruns_parser():
    def line(nnodes, node_rank, gpus, head, port):
        return (f"torchrun --nnodes {nnodes} --node_rank={node_rank} --nproc-per-node={gpus} --rdzv-backend=c10d "
                f"--rdzv-endpoint={head}:{port} -m course_lib.labs.hello")

    multi_node.check_torchrun_line(line)
    # c10d ranks the nodes itself: --node-rank left out (or 0 everywhere) passes, a wrong one does not
    multi_node.check_torchrun_line(lambda *a: line(*a).replace(f"--node_rank={a[1]} ", ""))
    multi_node.check_torchrun_line(lambda *a: line(a[0], 0, *a[2:]))
    with pytest.raises(ExerciseFailed, match=r"torchrun reads --node-rank as 2") as e:
        multi_node.check_torchrun_line(lambda *a: line(a[0], a[1] + 1, *a[2:]))
    assert "which one it is" not in str(e.value)
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


def test_17_2_checks_its_second_question_the_ranks_on_a_node():
    def rank(node, local, gpus):
        return node * gpus + local

    multi_node.check_global_rank(rank, lambda node, gpus: [rank(node, k, gpus) for k in range(gpus)])
    multi_node.check_global_rank(rank, lambda node, gpus: range(node * gpus, node * gpus + gpus))
    with pytest.raises(ExerciseFailed, match=r"the ranks on node 0 with 4 GPUs per node: you said \[0, 4\]"):
        multi_node.check_global_rank(rank, lambda node, gpus: [node + gpus * k for k in range(2)] if gpus == 4
                                     else list(range(node * gpus, node * gpus + gpus)))

