"""The nccl-tests-style sweep: busbw factors, the table/CSV/JSON/plot outputs, and the same CLI under the course
launcher (run()) and under `torchrun --standalone`. Small sizes only: these check behaviour, not speed."""

import csv
import json
import os
import shutil
import subprocess
import sys

import pytest

from course_lib.bench import collectives as bc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_busbw_factors_are_nccl_tests():
    n = 4
    assert bc.FACTORS["all_reduce"](n) == 1.5
    assert bc.FACTORS["reduce_scatter"](n) == bc.FACTORS["all_gather"](n) == bc.FACTORS["alltoall"](n) == 0.75
    assert bc.FACTORS["broadcast"](n) == bc.FACTORS["reduce"](n) == bc.FACTORS["sendrecv"](n) == 1.0


def test_sizes():
    assert bc.parse_size("4K") == 4096 and bc.parse_size("64M") == 64 << 20 and bc.parse_size("1GiB") == 1 << 30
    assert bc.sizes_between(4096, 32768) == [4096, 8192, 16384, 32768]


def test_predicted_ratios_for_four_ranks():
    r = bc.predicted_ratios(4)
    assert r["bandwidth_optimal_2x"] == 2.0
    assert r["binomial_trees"] == pytest.approx(2 * 2 / 1.5)
    assert r["gloo_algorithms"] == pytest.approx((0.75 + 0.75 + 2) / 1.5)   # ring RS + gather, binomial bcast
    assert r["shared_cpu_total_bytes"] == pytest.approx((3 + 0.75 + 3) / 6)


def test_one_prediction_for_the_reduce_broadcast_ratio():
    assert bc.predicted_ratio(4, one_host=True) == ("shared_cpu_total_bytes", pytest.approx((3 + 0.75 + 3) / 6))
    assert bc.predicted_ratio(4, one_host=False) == ("gloo_algorithms", pytest.approx((0.75 + 0.75 + 2) / 1.5))


def _times_over_ranks():
    import torch.distributed as dist

    value = float(dist.get_rank() + 1)
    return {how: bc._over_ranks(value, "cpu", how) for how in bc.AVERAGES}


def test_time_over_ranks_is_nccl_tests_average_option():
    from course_lib import run

    got = run(_times_over_ranks, 4, timeout=30, output="none").values
    assert got == [{"max": 4.0, "mean": 2.5, "min": 1.0, "rank0": 1.0}] * 4
    assert bc.AVERAGES == {"max": 3, "mean": 1, "min": 2, "rank0": 0}   # nccl-tests -a numbers


def test_torchrun_ranks_take_their_node_gpu_not_cuda_local_rank(monkeypatch):
    """Two torchrun "nodes" on one machine, one worker each: both have LOCAL_RANK 0; the node's GPU list decides."""
    import torch
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw["device_id"])))
    for node_gpus in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        monkeypatch.setenv("LAB_GPUS", node_gpus)
        assert bc._join("auto") == "nccl"
    assert calls == [("set_device", 0), ("nccl", torch.device("cuda", 0)),
                     ("set_device", 1), ("nccl", torch.device("cuda", 1))]
    calls.clear()
    monkeypatch.setenv("LAB_GPUS", "")                      # a node without GPUs: gloo, no device chosen
    assert bc._join("auto") == "gloo" and calls == [("gloo", None)]


def test_cli_under_the_course_launcher(tmp_path, capsys):
    out_csv, out_json, out_png = tmp_path / "s.csv", tmp_path / "s.json", tmp_path / "s.png"
    rc = bc.main(["--ranks", "3", "--ops", *bc.TORCH_OPS, *bc.COURSE_OPS, "--min-bytes", "4K", "--max-bytes", "8K",
                  "--iters", "2", "--warmup", "1", "--blocks", "1", "--ceiling-seconds", "0.05",
                  "--csv", str(out_csv), "--json", str(out_json), "--plot", str(out_png), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "# all_reduce (torch, gloo, 3 ranks)" in text and "busbw(GB/s)" in text and "ceilings" in text
    rows = list(csv.DictReader(open(out_csv)))
    assert len(rows) == 2 * (len(bc.TORCH_OPS) + len(bc.COURSE_OPS))
    for r in rows:
        factor = bc.FACTORS["all_reduce" if r["op"] in bc.COURSE_OPS + ["reduce+broadcast"] else r["op"]](3)
        assert float(r["busbw_GBps"]) == pytest.approx(float(r["algbw_GBps"]) * factor)
        assert float(r["algbw_GBps"]) == pytest.approx(int(r["size_bytes"]) / float(r["time_us"]) / 1e3)
        assert r["source"].startswith("measured on ") and " cores, " in r["source"] and "slowest rank" in r["source"]
        assert r["time_over_ranks"] == "max" and r["hosts"] == "1"
    summary = json.load(open(out_json))["summary"]
    assert "fit" in summary and summary["reduce_bcast_over_allreduce"]["model"] == "shared_cpu_total_bytes"
    assert out_png.stat().st_size > 1000


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="torchrun not installed")
def test_cli_unchanged_under_torchrun(tmp_path):
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    out_csv = tmp_path / "t.csv"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", "-m", "course_lib.bench.collectives",
                           "--ops", "all_reduce", "ring", "--min-bytes", "4K", "--max-bytes", "8K", "--iters", "2",
                           "--blocks", "1", "--ceiling-seconds", "0", "--csv", str(out_csv), "--no-progress"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("# all_reduce (torch, gloo, 2 ranks)") == 1      # rank 0 alone prints
    rows = list(csv.DictReader(open(out_csv)))
    assert {r["op"] for r in rows} == {"all_reduce", "ring"} and {r["ranks"] for r in rows} == {"2"}
