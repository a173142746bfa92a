"""Checkers of notebook 02's exercises (notebooks/02_cluster_architecture.ipynb): a link's transfer time, a ToR's
oversubscription, how many parameter servers catch a ring all-reduce, and which NIC each GPU of a server uses.

Each expected value is computed here from data/ (links.csv, training_runs.csv, nvidia_smi_topo_*.txt) and the
formulas the notebook states, never written in a check cell. While the learner's function runs, the course functions
that hold the answer are switched off (the ones the notebook itself calls, and this module's own references), so the
work is the learner's. A wrong answer gets what was given and a hint at the method, not the number.
"""

from __future__ import annotations

import math
import numbers

from ..costs import hardware as hw
from .core import ExerciseFailed, call_learner, passed, with_hint


def _plain(got):
    """A 0-d tensor or numpy scalar as the Python number it holds; anything else unchanged."""
    return got.item() if hasattr(got, "item") and getattr(got, "ndim", None) == 0 else got


def _number(exercise, got, what):
    got = _plain(got)
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
        raise ExerciseFailed(f"{exercise}: return {what} as a number; you returned {got!r}.")
    return got


# ---------------------------------------------------------------- Exercise 2.1
_TRANSFER = ("course_lib.costs.hardware.transfer_time_s", "course_lib.costs.hardware.gradient_transfer_table",
             "course_lib.checks.cluster._transfer_s")


def _transfer_s() -> float:
    """LLaMA-65B's fp16 gradients (2 bytes per parameter, data/training_runs.csv) over PCIe 4.0 x16 in one direction
    (data/links.csv: 31.5 GB/s, 16 GT/s x 16 lanes x 128/130 / 8)."""
    n_bytes = 2 * hw.row("training_runs", "LLaMA-65B")["params"]
    return n_bytes / (hw.row("links", "PCIe 4.0 x16")["GBps_one_direction"] * 1e9)


def check_gradient_transfer(exercise_2_1, exercise: str = "Exercise 2.1") -> None:
    """Seconds to send LLaMA-65B's fp16 gradients once over PCIe 4.0 x16, one direction, from the notebook's tables.
    Tolerance 0.1%: the inputs are exact table entries, so only rounding differs; 65e9 parameters instead of the
    table's 65.2e9 (0.3%), 32 GB/s without PCIe's 128b/130b encoding (1.6%) or GiB for GB (7%) are other answers."""
    hint = ("How many bytes is one fp16 gradient, how many parameters does data/training_runs.csv give LLaMA-65B, and "
            "how many bytes per second does data/links.csv give PCIe 4.0 x16 in one direction (GB = 1e9 bytes)?")
    got = _number(exercise, call_learner(exercise, exercise_2_1, hint=hint, library=_TRANSFER,
                                         why="turning bytes and a link's speed into seconds"), "seconds")
    if not math.isclose(got, _transfer_s(), rel_tol=1e-3):
        raise ExerciseFailed(with_hint(f"{exercise}: you said {got:.3g} s.", hint))
    return passed(exercise, f"{got:.2f} s")


# ---------------------------------------------------------------- Exercise 2.2
# (servers, GPUs each, ToR uplinks); (5, 8, 12) is 40 NICs on 12 uplinks, a ratio that is not a whole number
TOR_CASES = ((4, 8, 8), (3, 4, 4), (2, 8, 16), (4, 8, 64), (6, 8, 12), (5, 8, 12))


def _tor_share(servers: int, gpus: int, uplinks: int) -> tuple[float, float]:
    """(the ToR's oversubscription ratio, GB/s each way a GPU keeps when every GPU of the rack leaves it at once):
    every NIC and uplink InfiniBand NDR; a GPU never gets more than its own NIC."""
    nic = hw.row("links", "InfiniBand NDR")["GBps_one_direction"]
    ratio = servers * gpus / uplinks
    return ratio, nic / max(ratio, 1.0)


def _pair(got):
    """Any length-2 sequence or array of real numbers (0-d tensors, numpy scalars, Fractions) as two floats."""
    try:
        items = [_plain(g) for g in got] if not isinstance(got, (str, bytes)) else None
    except TypeError:
        items = None
    if items is None or len(items) != 2 or not all(isinstance(g, numbers.Real) and not isinstance(g, bool)
                                                    for g in items):
        return None
    return [float(g) for g in items]


def check_tor_share(tor_share, exercise: str = "Exercise 2.2") -> None:
    """``tor_share(servers, gpus_per_server, uplinks)`` for racks whose GPUs' NDR NICs all cable into one ToR with
    ``uplinks`` NDR links up: (oversubscription ratio, GB/s each way per GPU with every GPU leaving the rack).
    (5, 8, 12) has a ratio of 10/3, so rounding the ratio to GPUs per uplink gives 12.5 GB/s, not 15."""
    hint = ("How many NICs plug into the ToR from below, and how many links leave it upwards? When every GPU sends "
            "out of the rack at once, who shares the uplinks, and can a GPU ever send faster than its own NIC?")
    for case in TOR_CASES:
        raw = call_learner(exercise, tor_share, *case, hint=hint, library=("course_lib.checks.cluster._tor_share",),
                           why="a ToR's oversubscription")
        got = _pair(raw)
        if got is None:
            raise ExerciseFailed(f"{exercise}: return two numbers, (ratio, GB/s per GPU); you returned {raw!r}.")
        if not all(math.isclose(g, w, rel_tol=1e-3) for g, w in zip(got, _tor_share(*case))):
            servers, gpus, uplinks = case
            raise ExerciseFailed(with_hint(f"{exercise}: with {servers} servers of {gpus} GPUs and {uplinks} "
                                           f"uplinks you returned ({got[0]:.4g}, {got[1]:.4g}).", hint))
    return passed(exercise, f"{len(TOR_CASES)} racks, from {min(_tor_share(*c)[0] for c in TOR_CASES):g}:1 to "
                            f"{max(_tor_share(*c)[0] for c in TOR_CASES):g}:1")


# ---------------------------------------------------------------- Exercise 2.3
# Odd and even n: n // 2 + 1 happens to be right for every even n, wrong for odd n. No n here has a tie
# (n^2 / (2(n-1)) is an integer only for n = 2), so float rounding cannot move the answer.
WORKERS = (3, 5, 16, 33, 64)
_PS_FORMULAS = ("course_lib.costs.alpha_beta.ps_vs_allreduce", "course_lib.costs.alpha_beta.byteps_optimal",
                "course_lib.checks.cluster._fewest_servers")


def _fewest_servers(n: int) -> int:
    """Smallest k with the PS step no slower than the ring (section 4, BytePS's analysis, push and pull overlapped):
    max(M/B, nM/(kB)) <= 2(n-1)M/(nB). M/B cancels; in integers: n * n <= 2 (n - 1) k, the worker's own M/B being
    below the ring's for n >= 2."""
    return next(k for k in range(1, n + 1) if n * n <= 2 * (n - 1) * k)


def check_ps_servers_needed(ps_servers_needed, exercise: str = "Exercise 2.3") -> None:
    """``ps_servers_needed(n)``: the fewest parameter servers on machines of their own (each holding 1/k of the
    parameters) for which the PS step on n workers is no slower than the ring all-reduce, for several n."""
    hint = ("How many bytes cross a worker's NIC in each direction, and a server's, when k servers each hold 1/k of "
            "the parameters? The step lasts as long as the busiest NIC needs (push and pull overlap, as in section "
            "4); compare that with the ring's 2(n-1)/n M/B.")
    for n in WORKERS:
        got = _plain(call_learner(exercise, ps_servers_needed, n, hint=hint, library=_PS_FORMULAS,
                                  why="the traffic on a parameter server's NIC"))
        if isinstance(got, bool) or not isinstance(got, numbers.Real) or not float(got).is_integer():
            raise ExerciseFailed(f"{exercise}: return a whole number of servers; for n = {n} you returned {got!r}.")
        if int(got) != _fewest_servers(n):
            raise ExerciseFailed(with_hint(f"{exercise}: for n = {n} workers you said k = {int(got)}: with that many "
                                           "servers the PS is either still slower than the ring, or fewer would "
                                           "do.", hint))
    return passed(exercise, f"right for n = {', '.join(map(str, WORKERS))}; 16 workers need "
                            f"{_fewest_servers(16)} servers")


# ---------------------------------------------------------------- Exercise 2.4
# The two published servers (data/nvidia_smi_topo_8xH100.txt, data/nvidia_smi_topo_4xA100.txt) have PIX and SYS
# NICs only, so a made-up third server, the 4x A100 one rewired, holds the kinds they lack: a PXB NIC (GPUDirect RDMA
# on by default), and PHB and NODE as the closest kinds (off by default).
SERVERS = ("nvidia_smi_topo_8xH100", "nvidia_smi_topo_4xA100")
GDR_PATHS = ("PIX", "PXB")       # NCCL's default GPUDirect RDMA limit on a PCIe server (ncclTopoCheckGdr)
_NIC_PLAN = ("course_lib.costs.hardware.closest_nics", "course_lib.checks.cluster._nic_plan")


def _rewired() -> dict:
    """The 4x A100 server with GPU1-mlx5_0 PXB (not PIX), GPU0-mlx5_0 PHB and GPU3-mlx5_1 NODE (not SYS)."""
    topo = hw.nvidia_smi_topo("nvidia_smi_topo_4xA100")
    for gpu, nic, kind in (("GPU1", "mlx5_0", "PXB"), ("GPU0", "mlx5_0", "PHB"), ("GPU3", "mlx5_1", "NODE")):
        topo["path"][gpu][nic] = topo["path"][nic][gpu] = kind
    return topo


def _nic_plan(topo: dict) -> dict:
    """{GPU: (sorted NICs on its shortest PCIe path, whether that path is within GPUDirect RDMA's default reach)}."""
    plan = {}
    for gpu in topo["gpus"]:
        kinds = {nic: topo["path"][gpu][nic] for nic in topo["nics"]}
        best = min(kinds.values(), key=hw.PCIE_PATHS.index)
        plan[gpu] = (sorted(n for n, k in kinds.items() if k == best), best in GDR_PATHS)
    return plan


def _as_plan(got, gpus):
    """The learner's {GPU: (NICs, GDR on?)} with NICs sorted and GDR a bool; None when it has another shape."""
    if not isinstance(got, dict) or sorted(got) != sorted(gpus):
        return None
    out = {}
    for gpu, entry in got.items():
        try:
            nics, gdr = entry
            nics = [nics] if isinstance(nics, str) else sorted(nics)
        except (TypeError, ValueError):
            return None
        gdr = _plain(gdr)
        if not isinstance(gdr, bool) and type(gdr).__name__ != "bool_":
            return None
        out[gpu] = (nics, bool(gdr))
    return out


def check_nic_plan(nic_plan, exercise: str = "Exercise 2.4") -> None:
    """``nic_plan(topo)`` for a parsed `nvidia-smi topo -m`: for every GPU, the NICs on its shortest PCIe path (all
    of them when several tie) and whether GPUDirect RDMA is on there by default (PIX or PXB). Tried on both published
    servers and on a rewired one that has PXB, PHB and NODE paths."""
    hint = ("For one GPU, look along its row at the NIC columns only: which kind of path is the shortest (the legend "
            "lists them from farthest to closest), which NICs have it, and is that kind within GPUDirect RDMA's "
            "default reach on a PCIe server (section 1)?")
    cases = [(name, hw.nvidia_smi_topo(name)) for name in SERVERS] + [("a rewired 4x A100 server", _rewired())]
    for name, topo in cases:
        raw = call_learner(exercise, nic_plan, topo, hint=hint, library=_NIC_PLAN,
                           why="reading which NIC is a GPU's own")
        got = _as_plan(raw, topo["gpus"])
        if got is None:
            raise ExerciseFailed(f"{exercise}: return a dict with one entry per GPU ({', '.join(topo['gpus'])}), each "
                                 f"(a list of NIC names, True or False); on {name} you returned {raw!r:.200}.")
        want = _nic_plan(topo)
        for gpu in topo["gpus"]:
            if got[gpu] != want[gpu]:
                raise ExerciseFailed(with_hint(f"{exercise}: on {name} you said {gpu} uses {got[gpu][0]} with "
                                               f"GPUDirect RDMA {'on' if got[gpu][1] else 'off'}.", hint))
    a100 = _nic_plan(hw.nvidia_smi_topo("nvidia_smi_topo_4xA100"))
    far = [gpu for gpu, (_, gdr) in a100.items() if not gdr]
    return passed(exercise, f"{len(cases)} servers; on the 4x A100 one, {' and '.join(far)} reach every NIC only "
                            "across NUMA nodes")
