"""Checkers of the exercises answered by a formula or a command line (notebooks 07, 10, 12, 16; notebook 01's are in
test_checks_walls.py, 02's in test_checks_cluster.py, 17's in test_checks_multi_node.py): a right answer passes, a
wrong one fails without the expected value in the message, and a library function that holds the answer is refused
while the learner's function runs."""

import math

import pytest
import torch

from course_lib.checks import estimates
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.training import check_ring_bytes, check_servers_to_match_ring
from course_lib.costs import alpha_beta
from course_lib.costs import hardware as hw


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
        assert "Hint" in str(e.value) and "close" not in str(e.value), why

    def spent(n, r, w):                                                # do the restarts alone use up w?
        return r * n * _llama_rate() / 86400 >= w

    def unclamped(n, r, w):                                            # squares away a budget already spent
        m = 86400 / (n * _llama_rate())
        return (w - r / m) ** 2 * m / 2

    with pytest.raises(ExerciseFailed, match=r"100000 GPUs, 600 s per restart"):
        estimates.check_max_save_s(unclamped)
    with pytest.raises(ExerciseFailed, match=r"less than no time"):
        estimates.check_max_save_s(lambda n, r, w: -1.0 if spent(n, r, w) else _max_save_closed_form(n, r, w))


def _max_save_daly(n, r, w):
    """(b) another interval: Daly's sqrt(2C(M+R)) in place of Young's, searched by bisection; 7e-4 off at 16,384."""
    m = 86400 / (n * _llama_rate())
    if r / m >= w:
        return 0
    loss = lambda c: c / math.sqrt(2 * c * (m + r)) + math.sqrt(2 * c * (m + r)) / (2 * m) + r / m  # noqa: E731
    lo, hi = 0.0, m
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if loss(mid) <= w else (lo, mid)
    return lo


def test_max_save_refuses_the_checkers_own_answer_and_says_close_for_a_coarse_search():
    from course_lib.checks.estimates import _max_save_s

    with pytest.raises(ExerciseFailed, match=r"estimates\._max_save_s \(it holds the answer\) is switched off"):
        estimates.check_max_save_s(lambda n, r, w: _max_save_s(n, r, w))          # (a) one import away
    with pytest.raises(ExerciseFailed, match=r"close, within 1%.*Young's sqrt\(2CM\)"):
        estimates.check_max_save_s(_max_save_daly)                                   # (b) Daly's interval
    with pytest.raises(ExerciseFailed, match=r"close, within 1%: how precise is your search"):
        estimates.check_max_save_s(lambda n, r, w: round(_max_save_closed_form(n, r, w), 1))  # rounded to 0.1 s
    # (d) a grid search fine enough passes: saves from 1 ms to 1e5 s, 50,000 points a decade (5e-5 apart)
    def grid(n, r, w):
        m = 86400 / (n * _llama_rate())
        ok = [c for c in (10 ** (k / 50_000) for k in range(-150_000, 250_000))
              if c / math.sqrt(2 * c * m) + math.sqrt(2 * c * m) / (2 * m) + r / m <= w]
        return ok[-1] if ok else 0.0

    estimates.check_max_save_s(grid)

