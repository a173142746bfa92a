"""course_lib.costs.hardware against hand-computed cases, and the data/ tables it reads."""

import math

import pytest

from course_lib.costs import alpha_beta
from course_lib.costs import hardware as hw


# ----------------------------------------------------------------------------- tables
@pytest.mark.parametrize("table", ["accelerators", "links", "training_runs"])
def test_every_row_has_a_source(table):
    rows = hw.load_table(table)
    assert rows
    for r in rows:
        assert isinstance(r["source"], str) and len(r["source"]) > 10, r["name"]


def test_tables_cover_what_the_issue_asks():
    acc = {r["name"] for r in hw.accelerators()}
    for want in ["V100 SXM2 32GB", "A100 40GB SXM", "A100 80GB SXM", "H100 SXM 80GB", "H200 SXM 141GB",
                 "B200 (HGX)", "RTX 4090"]:
        assert want in acc
    kinds = {(r["kind"], r["name"]) for r in hw.links()}
    assert {k for k, _ in kinds} == {"PCIe", "NVLink", "InfiniBand", "Ethernet", "Omni-Path"}
    assert len(kinds) == 14
    runs = {r["name"] for r in hw.training_runs()}
    assert runs == {"GPT-3 175B", "OPT-175B", "BLOOM-176B", "LLaMA-7B", "LLaMA-13B", "LLaMA-33B", "LLaMA-65B"}


def test_bandwidth_directions_are_consistent():
    # every table says one-direction and both-directions; both = 2 x one for full-duplex links
    for r in hw.links():
        assert r["GBps_bidirectional"] == pytest.approx(2 * r["GBps_one_direction"])
        if r["line_rate_Gbps"] and r["kind"] != "PCIe":
            assert r["GBps_one_direction"] == pytest.approx(r["line_rate_Gbps"] / 8)
    for r in hw.accelerators():
        assert r["nvlink_GBps_bidirectional"] == 2 * r["nvlink_GBps_one_direction"]


def test_datasheet_figures_in_the_tables():
    # H100 datasheet: NVLink 4 = 18 links, 900 GB/s both ways, 450 each way; PCIe 5 x16 63 GB/s each way
    h100 = hw.row("accelerators", "H100 SXM 80GB")
    nv = (h100["nvlink_links"], h100["nvlink_GBps_bidirectional"], h100["nvlink_GBps_one_direction"])
    assert nv == (18, 900, 450)
    assert hw.row("links", "PCIe 5.0 x16")["GBps_one_direction"] == pytest.approx(64, rel=0.02)
    bloom = hw.row("training_runs", "BLOOM-176B")
    assert bloom["gpus"] == 384 and bloom["tflops_per_gpu"] == 150
    opt = hw.row("training_runs", "OPT-175B")
    assert opt["gpus"] == 992 and opt["tflops_per_gpu"] == 147
    llama = {r["name"]: r["gpu_hours"] for r in hw.training_runs() if r["name"].startswith("LLaMA")}
    assert llama == {"LLaMA-7B": 82432, "LLaMA-13B": 135168, "LLaMA-33B": 530432, "LLaMA-65B": 1022362}


def test_unknown_row_names_the_choices():
    with pytest.raises(KeyError, match="A100 80GB SXM"):
        hw.row("accelerators", "A100")


# ----------------------------------------------------------------------------- memory wall
def test_gpt3_fp32_weights_are_700_GB():
    assert hw.weights_bytes(175e9, 4) == 700e9


def test_training_state_16_bytes_per_param():
    mixed = hw.training_state_bytes(175e9, "mixed")
    assert mixed == {"weights": 350e9, "gradients": 350e9, "optimizer": 2100e9, "total": 2800e9}
    fp32 = hw.training_state_bytes(1e9, "fp32")
    assert fp32["total"] == 16e9 and fp32["weights"] == 4e9 and fp32["optimizer"] == 8e9


def test_gpus_to_hold():
    # a number is decimal GB (a what-if); an accelerator's row or name is its real capacity
    assert hw.gpus_to_hold(700e9, 80) == 9           # 700/80 = 8.75 -> 9
    assert hw.gpus_to_hold(2800e9, 80) == 35         # 2800/80 = 35 exactly
    assert hw.gpus_to_hold(80e9, 80) == 1
    a100, h100 = hw.row("accelerators", "A100 80GB SXM"), hw.row("accelerators", "H100 SXM 80GB")
    assert hw.gpus_to_hold(700e9, a100) == 9         # GPT-3's fp32 weights: 700e9 / 85.9e9 = 8.1 -> 9
    assert hw.gpus_to_hold(2800e9, a100) == 33       # GPT-3's mixed-precision Adam state: 32.6 -> 33, not 35
    assert hw.gpus_to_hold(16 * 65.2e9, "H100 SXM 80GB") == 13   # LLaMA-65B: 1.0432e12 / 85.5e9 = 12.2 -> 13
    assert hw.gpus_to_hold(hw.memory_bytes(h100), h100) == 1


def test_memory_is_in_binary_units():
    # nvidia-smi's totals: A100 80GB 81920 MiB = exactly 80 GiB; H100 SXM 81559 MiB
    assert hw.memory_bytes("A100 80GB SXM") == 81920 * 2**20 == 80 * 2**30
    assert hw.memory_bytes("H100 SXM 80GB") == 81559 * 2**20
    assert hw.memory_bytes("V100 SXM2 32GB") == 32 * 2**30          # no nvidia-smi figure: the name's size in GiB
    for r in hw.accelerators():
        assert r["memory_GB"] * 2**30 * 0.98 < hw.memory_bytes(r) <= r["memory_GB"] * 2**30, r["name"]


def test_activation_formula_by_hand():
    # one layer, s=2, b=1, h=4, a=2: 2*1*4*(34 + 5*2*2/4) = 8 * 39 = 312 bytes
    assert hw.activation_bytes(1, 4, 2, 1, 2) == 312


# ----------------------------------------------------------------------------- compute wall
def test_6nd():
    assert hw.training_flops(175e9, 300e9) == pytest.approx(3.15e23)
    # GPT-3 paper table D.1 gives 3.14e23 FLOPs for 175B: 6ND agrees within 1%
    assert hw.training_flops(175e9, 300e9) == pytest.approx(3.14e23, rel=0.01)


def test_training_time_by_hand():
    # 1e18 FLOPs on 10 GPUs of 100 TFLOP/s at 50% MFU: 1e18 / (10 * 1e14 * 0.5) = 2000 s
    assert hw.training_time_s(1e18, 10, 100, 0.5) == pytest.approx(2000)
    assert hw.gpu_hours(3.6e15, 1e12) == pytest.approx(1)


def test_llama_65b_gpu_hours_from_6nd_within_15_percent():
    rows = {r["name"]: r for r in hw.llama_gpu_hours_check()}
    r65 = rows["LLaMA-65B"]
    # by hand: 6 x 65.2e9 x 380 = 148.7 TFLOP/s per GPU; 6 x 65.2e9 x 1.4e12 / 148.7e12 / 3600 = 1,023,392 h
    assert r65["achieved_TFLOPS"] == pytest.approx(148.656)
    assert r65["predicted_gpu_hours"] == pytest.approx(1.4e12 / 380 / 3600)
    assert abs(r65["error"]) < 0.15
    # the same achieved FLOP/s predicts the other sizes within 15% too
    for name, r in rows.items():
        assert abs(r["error"]) < 0.15, (name, r["error"])
    assert 0.45 < r65["mfu"] < 0.50  # 148.7 of 312 bf16 TFLOP/s on an A100
    # 65B's own rate is the input: only the other three runs test the model
    assert [n for n, r in rows.items() if r["used_to_fit"]] == ["LLaMA-65B"]


def test_llama_65b_wall_clock_is_about_21_days():
    r = hw.row("training_runs", "LLaMA-65B")
    days = r["tokens"] / (r["tokens_per_s_per_gpu"] * r["gpus"]) / 86400
    assert days == pytest.approx(21, rel=0.05)


# ----------------------------------------------------------------------------- speed formula
def test_speed_formula_uses_the_ring_cost():
    p, t, n, a, b = 8, 0.1, 1e8, 1e-5, 1e-9
    r = hw.data_parallel_speed(p, t, n, a, b, samples_per_step=32)
    comm = alpha_beta.ring_allreduce(p, n, a, b)
    assert r["comm_s"] == comm
    assert r["speedup_ratio"] == pytest.approx(t / (t + comm))
    assert r["speed"] == pytest.approx(32 / t * p * t / (t + comm))


def test_speedup_ratio_falls_as_devices_grow():
    curve = hw.speed_curve([1, 2, 4, 8, 64, 512], 0.1, 1e8, 1e-5, 1e-9)
    ratios = [c["speedup_ratio"] for c in curve]
    assert ratios[0] == 1.0
    assert all(x > y for x, y in zip(ratios, ratios[1:]))
    assert all(c["speed"] <= c["devices"] * c["single_device_speed"] for c in curve)


def test_weak_and_strong_scaling_by_hand():
    c, n, a, b = 0.01, 1e9, 1e-5, 1 / 25e9      # 10 ms per sequence, 1 GB of gradients
    comm = alpha_beta.ring_allreduce(64, n, a, b)
    weak = hw.scaling(64, c, n, a, b, seqs_per_gpu=8)
    assert weak["speedup"] == pytest.approx(64 * 8 * c / (8 * c + comm))
    strong = hw.scaling(64, c, n, a, b, global_batch=2048)
    assert strong["seqs_per_gpu"] == 32 and strong["speedup"] == pytest.approx(2048 * c / (32 * c + comm))
    # fixed global batch: compute per step shrinks with p, the all-reduce does not, so efficiency collapses
    eff = [hw.scaling(p, c, n, a, b, global_batch=2048)["efficiency"] for p in (2, 16, 256, 2048)]
    assert all(x > y for x, y in zip(eff, eff[1:])) and eff[-1] < 0.5
    assert hw.scaling(2048, c, n, a, b, global_batch=2048)["fits"] and not hw.scaling(4096, c, n, a, b,
                                                                                        global_batch=2048)["fits"]
    with pytest.raises(ValueError):
        hw.scaling(8, c, n, a, b)


# ----------------------------------------------------------------------------- transfer time
def test_transfer_time_by_hand():
    # 350 GB (GPT-3 fp16 gradients) over NVLink 4 at 450 GB/s one way: 0.778 s (+1 us latency)
    assert hw.transfer_time_s(350e9, "NVLink 4 (H100)") == pytest.approx(350 / 450 + 1e-6)
    # over 100 Gb/s InfiniBand EDR = 12.5 GB/s: 28 s
    assert hw.transfer_time_s(350e9, "InfiniBand EDR") == pytest.approx(28, rel=1e-6)


def test_gradient_table_orders_links_sensibly():
    t = {r["link"]: r["seconds"] for r in hw.gradient_transfer_table(175e9)}
    assert len(t) == 14
    assert t["NVLink 5 (B200)"] < t["NVLink 4 (H100)"] < t["PCIe 5.0 x16"] < t["PCIe 4.0 x16"] < t["PCIe 3.0 x16"]
    assert t["Ethernet 25 GbE"] == max(t.values())
    assert math.isclose(t["Ethernet 100 GbE"], t["InfiniBand EDR"], rel_tol=1e-3)
