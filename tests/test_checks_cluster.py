"""Notebook 02's checkers (course_lib/checks/cluster.py) as a learner meets them: (a) the course function that holds
the answer is refused, (b) a wrong method that gives the right number on one case fails on another, (c) plausible
wrong answers fail without the expected value in the message, (d) right answers written differently pass."""

import math

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
    for wrong in (lambda s, g, u: (s / u, NIC / max(s / u, 1)),          # servers counted, not NICs
                  lambda s, g, u: (s * g / u, NIC / (s * g / u)),        # (b) right while ratio >= 1: NIC exceeded
                  lambda s, g, u: (u / (s * g), NIC / max(s * g / u, 1)),   # ratio upside down
                  lambda s, g, u: (s * g / u, NIC)):                     # the uplinks never shared
        with pytest.raises(ExerciseFailed, match=r"Exercise 2\.2: with \d+ servers"):
            cluster.check_tor_share(wrong)
    with pytest.raises(ExerciseFailed, match=r"return two numbers"):
        cluster.check_tor_share(lambda s, g, u: s * g / u)
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
