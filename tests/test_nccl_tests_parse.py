"""The nccl-tests output reader (course_lib.measure.nccl_tests) reads both published outputs the course ships, in the
formats nccl-tests prints, and exercise 7.3's checker passes a right prediction however it is written and fails the
shortcuts: the run's own time, nGpus taken for the number of ranks, busbw without its factor, GiB for GB."""

import math

import numpy as np
import pytest
import torch

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.nccl_tests import check_predicted_time
from course_lib.costs import alpha_beta
from course_lib.costs import hardware as hw
from course_lib.measure import nccl_tests

ONE_NODE = hw.nccl_tests_output("nccl_tests_all_reduce_8xH100")
TWO_NODES = hw.nccl_tests_output("nccl_tests_all_reduce_2x8xH100")


def test_the_one_node_output_reads_whole():
    out = nccl_tests.parse(ONE_NODE)
    assert out["header"] == {"nThread": 1, "nGpus": 8, "minBytes": 128 << 20, "maxBytes": 4 << 30, "step": 2,
                             "step_kind": "factor", "warmup_iters": 5, "iters": 2, "agg_iters": 1, "validation": 1,
                             "graph": 0}
    assert nccl_tests.n_ranks(out) == 8 and {r["name"] for r in out["ranks"]} == {"NVIDIA H100 80GB HBM3"}
    assert [r["rank"] for r in out["ranks"]] == list(range(8)) and out["ranks"][7]["bus"] == "0xc1"
    assert len(out["rows"]) == 12 and [r["placement"] for r in out["rows"][:2]] == ["out-of-place", "in-place"]
    first = out["rows"][0]
    assert first == {"size_bytes": 134217728, "count": 33554432, "dtype": "float", "redop": "sum", "root": -1,
                     "placement": "out-of-place", "time_us": 613.3, "algbw_GBps": 218.85, "busbw_GBps": 382.99,
                     "wrong": 0}
    assert out["rows"][-1]["time_us"] == 15773 and out["out_of_bounds"] == 0 and out["avg_busbw_GBps"] == 439.369


def test_the_printed_numbers_obey_nccl_tests_definitions():
    # doc/PERFORMANCE.md: algbw = S/t, busbw = algbw x 2(n-1)/n; the footer is the mean of every busbw printed
    for text in (ONE_NODE, TWO_NODES):
        out = nccl_tests.parse(text)
        n = nccl_tests.n_ranks(out)
        for r in out["rows"]:
            # time has 4-5 significant digits, algbw and busbw 2 decimals: 0.1% covers the rounding
            assert math.isclose(nccl_tests.seconds_per_call(r) * 1e6, r["time_us"], rel_tol=1e-3)
            assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * 2 * (n - 1) / n, rel_tol=1e-3)
        mean = sum(r["busbw_GBps"] for r in out["rows"]) / len(out["rows"])
        assert math.isclose(mean, out["avg_busbw_GBps"], abs_tol=0.005)


def test_srun_labels_validation_off_and_one_gpu_per_process():
    out = nccl_tests.parse(TWO_NODES)
    assert out["header"]["nGpus"] == 1 and out["header"]["validation"] == 0
    assert nccl_tests.n_ranks(out) == 16 and {r["host"] for r in out["ranks"]} == {"node005", "node007"}
    assert len(out["rows"]) == 22 and all(r["wrong"] is None for r in out["rows"])     # N/A: validation off
    assert out["avg_busbw_GBps"] == 142.735


def test_an_older_table_without_root_and_with_an_error_column():
    # nccl-tests before 2021 printed no root column and the largest error instead of #wrong
    text = """# nThread 1 nGpus 2 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
# Using devices
#   Rank  0 Pid 110419 on test-a device  0 [0x3b] Tesla T4
#   Rank  1 Pid 110419 on test-a device  1 [0x86] Tesla T4
#
#                                                     out-of-place                       in-place
#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2   float     sum    20.36    0.00    0.00  0e+00    20.07    0.00    0.00  0e+00
   134217728      33554432   float     sum    22030    6.09    6.09  0e+00    21990    6.10    6.10  0e+00
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 1.52
"""
    out = nccl_tests.parse(text)
    assert "agg_iters" not in out["header"] and nccl_tests.n_ranks(out) == 2
    assert out["ranks"][1]["group"] is None and out["ranks"][1]["name"] == "Tesla T4"
    last = out["rows"][-1]
    assert "root" not in last and last["placement"] == "in-place" and last["time_us"] == 21990
    assert last["busbw_GBps"] == 6.10 and last["wrong"] == 0.0


def test_a_text_without_a_table_is_refused():
    with pytest.raises(ValueError, match="no table row"):
        nccl_tests.parse("# nThread 1 nGpus 8 minBytes 8 maxBytes 8 step: 2(factor) warmup iters: 1 iters: 20\n")


# ---------------------------------------------------------------- exercise 7.3
def _out_of_place(text, size):
    return next(r for r in nccl_tests.parse(text)["rows"]
                if r["size_bytes"] == size and r["placement"] == "out-of-place")


def _from_busbw(text, size, n):
    return size * 2 * (n - 1) / n / (_out_of_place(text, size)["busbw_GBps"] * 1e9)


def _from_algbw_and_the_rank_lines(text, size, n):
    """Written differently: busbw rebuilt from algbw with the run's own rank count, then the ring's time with
    alpha = 0 and beta = 1 / busbw (notebook 06's formula)."""
    out = nccl_tests.parse(text)
    m = sum(1 for line in text.splitlines() if "#  Rank" in line)
    busbw = _out_of_place(text, size)["algbw_GBps"] * 1e9 * 2 * (m - 1) / m
    assert m == nccl_tests.n_ranks(out)
    return alpha_beta.ring_allreduce(n, size, 0.0, 1 / busbw)


def test_a_right_prediction_passes_however_it_is_written(capsys):
    check_predicted_time(_from_busbw)
    check_predicted_time(_from_algbw_and_the_rank_lines)
    check_predicted_time(lambda text, size, n: torch.tensor(_from_busbw(text, size, n)))    # a 0-d tensor
    check_predicted_time(lambda text, size, n: np.float32(_from_busbw(text, size, n)))     # float32: 1e-7 rel.
    assert capsys.readouterr().out.count("✓ Exercise 7.3 passed") == 4


@pytest.mark.parametrize("wrong, why", [
    (lambda text, size, n: nccl_tests.seconds_per_call(_out_of_place(text, size)),        # the library's t = S/algbw
     "the run's own time, whatever n"),
    (lambda text, size, n: _out_of_place(text, size)["time_us"] * 1e-6 * (2 * (n - 1) / n)
     / (2 * (nccl_tests.parse(text)["header"]["nGpus"] - 1) / nccl_tests.parse(text)["header"]["nGpus"] or 1),
     "nGpus of the header taken for the number of ranks"),
    (lambda text, size, n: size / (_out_of_place(text, size)["busbw_GBps"] * 1e9), "busbw without the factor"),
    (lambda text, size, n: size * 2 * (n - 1) / n / (_out_of_place(text, size)["busbw_GBps"] * 2**30), "GiB for GB"),
    (lambda text, size, n: _from_busbw(text, size, n) * 1e6, "microseconds returned for seconds"),
])
def test_wrong_methods_fail_without_the_answer(wrong, why):
    with pytest.raises(ExerciseFailed, match=r"Exercise 7\.3: on the \d+-GPU output") as e:
        check_predicted_time(wrong)
    assert "Hint:" in str(e.value), why


def test_numbers_typed_in_from_the_one_node_output_fail_on_the_other():
    table = {(size, n): _from_busbw(ONE_NODE, size, n) for size in (1 << 30, 2 << 30, 4 << 30)
             for n in (2, 4, 8, 16)}
    with pytest.raises(ExerciseFailed, match=r"on the 16-GPU output \(two nodes\)"):
        check_predicted_time(lambda text, size, n: table[(size, n)] if (size, n) in table else 1.0)


def test_the_checked_n_stay_inside_each_runs_fabric():
    # busbw carries over only on the fabric that measured it: one node's NVLink, or the same two nodes
    from course_lib.checks.nccl_tests import CASES

    asked = {name: {n for _, n in cases} for name, _, cases in CASES}
    assert asked == {"nccl_tests_all_reduce_8xH100": {2, 4, 8}, "nccl_tests_all_reduce_2x8xH100": {8, 16}}
    for name, _, cases in CASES:                 # either placement's row passes: they agree within the tolerance
        rows = nccl_tests.parse(hw.nccl_tests_output(name))["rows"]
        for size, _ in cases:
            a, b = (r["busbw_GBps"] for r in rows if r["size_bytes"] == size)
            assert math.isclose(a, b, rel_tol=0.005)


def test_the_checkers_own_answer_is_switched_off():
    from course_lib.checks import nccl_tests as checker

    with pytest.raises(ExerciseFailed, match=r"_expected_seconds \(it holds the answer\) is switched off"):
        check_predicted_time(lambda text, size, n: checker._expected_seconds(text, size, n))
    assert checker._expected_seconds(ONE_NODE, 1 << 30, 8) > 0                      # and it works again afterwards


def test_the_student_copy_stub_reads_as_not_attempted():
    def stub(text, size, n):
        raise NotImplementedError("Exercise 7.3: predict the time: write your solution here")

    with pytest.raises(NotImplementedError, match="Exercise 7.3: not attempted yet"):
        check_predicted_time(stub)
