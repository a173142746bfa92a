"""Notebook 02's checkers (course_lib/checks/cluster.py) as a learner meets them: (a) the course function that holds
the answer is refused, (b) a wrong method that gives the right number on one case fails on another, (c) plausible
wrong answers fail without the expected value in the message, (d) right answers written differently pass."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from course_lib.checks import cluster
from course_lib.checks.core import ExerciseFailed
from course_lib.costs import alpha_beta
from course_lib.costs import hardware as hw

PARAMS = hw.row("training_runs", "LLaMA-65B")["params"]
PCIE4 = hw.row("links", "PCIe 4.0 x16")["GBps_one_direction"]
NIC = hw.row("links", "InfiniBand NDR")["GBps_one_direction"]


def test_gradient_transfer():
    seconds = 2 * PARAMS / (PCIE4 * 1e9)
    assert math.isclose(seconds, 4.14, rel_tol=1e-3)               # 130.4 GB over 31.5 GB/s
    cluster.check_gradient_transfer(lambda: seconds)                                       # (d) the solution's way
    cluster.check_gradient_transfer(lambda: np.float64(2 * PARAMS / (16e9 * 16 / 8 * 128 / 130)))   # (d) from GT/s
    cluster.check_gradient_transfer(lambda: torch.tensor(seconds))                        # (d) a 0-d tensor
    for shortcut, what in ((lambda: hw.transfer_time_s(2 * PARAMS, "PCIe 4.0 x16"), r"hardware\.transfer_time_s"),
                           (lambda: hw.gradient_transfer_table(PARAMS)[1]["seconds"],
                            r"hardware\.gradient_transfer_table"),
                           (lambda: cluster._transfer_s(), r"checks\.cluster\._transfer_s")):   # (a)
        with pytest.raises(ExerciseFailed, match=what + r" \(it holds the answer\) is switched off"):
            cluster.check_gradient_transfer(shortcut)
    for wrong in (lambda: seconds / 2,                              # fp16 taken as 1 byte
                  lambda: 2 * 65e9 / (PCIE4 * 1e9),                 # the name's 65e9, not the table's 65.2e9
                  lambda: 2 * PARAMS / 32e9,                        # 16 GT/s x 16 lanes without 128b/130b
                  lambda: 2 * PARAMS / (PCIE4 * 2**30),             # GiB/s for GB/s
                  lambda: 2 * PARAMS / (2 * PCIE4 * 1e9)):          # both directions added
        with pytest.raises(ExerciseFailed, match=r"Exercise 2\.1: you said") as e:               # (c)
            cluster.check_gradient_transfer(wrong)
        assert f"{seconds:.3g}" not in str(e.value) and "Hint" in str(e.value)
    with pytest.raises(ExerciseFailed, match=r"return seconds as a number"):
        cluster.check_gradient_transfer(lambda: "4.14 s")


def test_tor_share():
    def share(servers, gpus, uplinks):
        ratio = servers * gpus / uplinks
        return ratio, NIC / max(ratio, 1)

    def share_in_bandwidth(servers, gpus, uplinks):   # (d) written differently: GB/s down over GB/s up, NIC cap
        down, up = servers * gpus * NIC, uplinks * NIC
        return down / up, min(NIC, up / (servers * gpus))

    cluster.check_tor_share(share)
    cluster.check_tor_share(share_in_bandwidth)
    cluster.check_tor_share(lambda s, g, u: [np.float64(s * g / u), np.float64(min(NIC, NIC * u / (s * g)))])
    cluster.check_tor_share(lambda s, g, u: np.array(share(s, g, u)))                  # (d) an array
    cluster.check_tor_share(lambda s, g, u: (Fraction(s * g, u), NIC / max(Fraction(s * g, u), 1)))   # (d) Fraction
    cluster.check_tor_share(lambda s, g, u: torch.tensor(share(s, g, u)))               # (d) a tensor of two
    for wrong in (lambda s, g, u: (s / u, NIC / max(s / u, 1)),          # servers counted, not NICs
                  lambda s, g, u: (s * g / u, NIC / (s * g / u)),        # (b) right while ratio >= 1: NIC exceeded
                  lambda s, g, u: (u / (s * g), NIC / max(s * g / u, 1)),   # ratio upside down
                  lambda s, g, u: (s * g / u, NIC),                      # the uplinks never shared
                  lambda s, g, u: (s * g / u, NIC / max(math.ceil(s * g / u), 1))):   # (b) whole GPUs per uplink
        with pytest.raises(ExerciseFailed, match=r"Exercise 2\.2: with \d+ servers"):
            cluster.check_tor_share(wrong)
    for not_two in (lambda s, g, u: s * g / u, lambda s, g, u: (s * g / u, NIC, 0), lambda s, g, u: ("4", "12.5")):
        with pytest.raises(ExerciseFailed, match=r"return two numbers"):
            cluster.check_tor_share(not_two)
    with pytest.raises(ExerciseFailed, match=r"checks\.cluster\._tor_share \(it holds the answer\) is switched off"):
        cluster.check_tor_share(lambda s, g, u: cluster._tor_share(s, g, u))                     # (a)


def test_ps_servers_needed():
    def by_search(n):                # the solution's way: grow k until the busiest NIC is no busier than the ring's
        ring, k = 2 * (n - 1) / n, 1
        while max(1, n / k) > ring:
            k += 1
        return k

    def closed_form(n):              # (d) written differently: k >= n^2 / (2(n-1)), returned as a float
        return float(math.ceil(n * n / (2 * (n - 1))))

    assert [by_search(n) for n in cluster.WORKERS] == [3, 4, 9, 18, 33]
    cluster.check_ps_servers_needed(by_search)
    cluster.check_ps_servers_needed(closed_form)
    for shortcut, what in (
            (lambda n: next(k for k in range(1, n + 1) if alpha_beta.ps_vs_allreduce(n, 1, 1, k)["ps_s"]
                            <= alpha_beta.ps_vs_allreduce(n, 1, 1, k)["allreduce_s"]), r"alpha_beta\.ps_vs_allreduce"),
            (lambda n: next(k for k in range(1, n + 1) if alpha_beta.byteps_optimal(n, 1, 1, k)
                            <= 2 * (n - 1) / n), r"alpha_beta\.byteps_optimal"),
            (lambda n: cluster._fewest_servers(n), r"checks\.cluster\._fewest_servers")):          # (a)
        with pytest.raises(ExerciseFailed, match=what + r" \(it holds the answer\) is switched off"):
            cluster.check_ps_servers_needed(shortcut)
    for wrong, n in ((lambda n: 9, 3),                                  # the 16-worker answer, fixed
                     (lambda n: n // 2 + 1, 3),                         # (b) right for every even n, not odd
                     (lambda n: math.ceil(n / 2), 3),                   # the ring's traffic read as M, not 2(n-1)/n M
                     (lambda n: n, 5),                                  # a server per worker: no slower, not fewest
                     (lambda n: 2 * by_search(n), 3),                   # push then pull counted twice on one link
                     (lambda n: by_search(n) - 1, 3)):                  # one short
        with pytest.raises(ExerciseFailed, match=rf"Exercise 2\.3: for n = {n} workers you said") as e:   # (c)
            cluster.check_ps_servers_needed(wrong)
        assert "Hint" in str(e.value)
    with pytest.raises(ExerciseFailed, match=r"return a whole number of servers"):
        cluster.check_ps_servers_needed(lambda n: n * n / (2 * (n - 1)))


def test_nic_plan():
    def by_rows(topo):                  # the solution's way: the closest kind in the GPU's row, its NICs, PIX/PXB
        plan = {}
        for gpu in topo["gpus"]:
            kinds = {nic: topo["path"][gpu][nic] for nic in topo["nics"]}
            best = min(kinds.values(), key=hw.PCIE_PATHS.index)
            plan[gpu] = ([n for n, k in kinds.items() if k == best], best in ("PIX", "PXB"))
        return plan

    def by_rank(topo):                  # (d) written differently: rank every NIC, keep ties, a set and a numpy bool
        order = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}
        out = {}
        for gpu in topo["gpus"]:
            rank = {nic: order[topo["path"][gpu][nic]] for nic in topo["nics"]}
            best = min(rank.values())
            out[gpu] = ({n for n, r in rank.items() if r == best}, np.bool_(best <= 1))
        return out

    a100 = hw.nvidia_smi_topo("nvidia_smi_topo_4xA100")
    assert by_rows(a100) == {"GPU0": (["mlx5_0", "mlx5_1"], False), "GPU1": (["mlx5_0"], True),
                             "GPU2": (["mlx5_1"], True), "GPU3": (["mlx5_0", "mlx5_1"], False)}
    cluster.check_nic_plan(by_rows)
    cluster.check_nic_plan(by_rank)
    for shortcut, what in ((lambda t: {g: (n, k in ("PIX", "PXB")) for g, (n, k) in hw.closest_nics(t).items()},
                            r"hardware\.closest_nics"),
                           (lambda t: cluster._nic_plan(t), r"checks\.cluster\._nic_plan")):         # (a)
        with pytest.raises(ExerciseFailed, match=what + r" \(it holds the answer\) is switched off"):
            cluster.check_nic_plan(shortcut)

    def same_index(topo):               # (b) NIC i for GPU i: right on the 8x H100 server only
        return {g: ([topo["nics"][int(g[3:]) % len(topo["nics"])]], True) for g in topo["gpus"]}

    def pix_only(topo):                 # (b) GPUDirect RDMA on PIX only: right on both published servers
        return {g: (n, k == "PIX") for g, (n, k) in by_kind(topo).items()}

    def by_kind(topo):
        return {g: (p[0], p[1]) for g, p in ((g, _closest(topo, g)) for g in topo["gpus"])}

    def _closest(topo, gpu):
        kinds = {nic: topo["path"][gpu][nic] for nic in topo["nics"]}
        best = min(kinds.values(), key=hw.PCIE_PATHS.index)
        return [n for n, k in kinds.items() if k == best], best

    def not_sys(topo):                  # (c) "on unless it crosses the CPUs' interconnect": PHB and NODE let through
        return {g: (n, k != "SYS") for g, (n, k) in by_kind(topo).items()}

    def first_only(topo):               # (c) one NIC where several tie
        return {g: (n[:1], k in ("PIX", "PXB")) for g, (n, k) in by_kind(topo).items()}

    def upside_down(topo):              # (c) the farthest NICs, read the legend the wrong way round
        plan = {}
        for gpu in topo["gpus"]:
            kinds = {nic: topo["path"][gpu][nic] for nic in topo["nics"]}
            worst = max(kinds.values(), key=hw.PCIE_PATHS.index)
            plan[gpu] = ([n for n, k in kinds.items() if k == worst], worst in ("PIX", "PXB"))
        return plan

    for wrong in (same_index, pix_only, not_sys, first_only, upside_down):
        with pytest.raises(ExerciseFailed, match=r"Exercise 2\.4: on .* you said GPU\d uses") as e:
            cluster.check_nic_plan(wrong)
        assert "Hint" in str(e.value)
    for bad_shape in (lambda t: [by_rows(t)], lambda t: {g: p[0] for g, p in by_rows(t).items()},
                      lambda t: {g: (p[0], "yes") for g, p in by_rows(t).items()}):
        with pytest.raises(ExerciseFailed, match=r"return a dict with one entry per GPU"):
            cluster.check_nic_plan(bad_shape)
