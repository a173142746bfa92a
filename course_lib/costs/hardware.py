"""The data/ hardware tables (accelerators, links, training runs) and the walls computed from them.

Taught in notebooks/01_why_distributed.ipynb (memory wall, compute wall, speed formula) and
notebooks/02_cluster_architecture.ipynb (links, transfer times). Units: bytes, seconds, FLOPs; GB = 1e9 bytes,
GiB = 2**30 bytes, GB/s one direction unless a name says otherwise. An accelerator's memory is NOT in GB: the "80GB"
of an A100 80GB is 80 GiB (nvidia-smi: 81920 MiB); memory_bytes() reads it right.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

from . import alpha_beta

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
GB = 1e9
GiB = 2**30
MiB = 2**20

# Bytes per parameter of the training state with Adam (ZeRO paper, Rajbhandari et al. SC'20, section 3.1):
# fp32 keeps weights, grads, momentum, variance in fp32 (4+4+4+4); mixed precision keeps fp16 weights and grads
# (2+2) plus an fp32 master copy, momentum and variance (4+4+4 = 12): 16 bytes per parameter either way, but
# mixed precision halves what the forward/backward pass reads and what the all-reduce sends.
STATE_BYTES_PER_PARAM = {
    "fp32": {"weights": 4, "gradients": 4, "optimizer": 8},
    "mixed": {"weights": 2, "gradients": 2, "optimizer": 12},
}


# ---------------------------------------------------------------------------------------------- tables
def _value(text: str):
    """'' -> None, numbers -> float (int when whole), anything else stays a string."""
    if text == "":
        return None
    try:
        x = float(text)
    except ValueError:
        return text
    return int(x) if x.is_integer() and "." not in text and "e" not in text.lower() else x


def load_table(name: str) -> list[dict]:
    """Rows of data/<name>.csv as dicts with numbers parsed; every row keeps its `source`."""
    with open(DATA_DIR / f"{name}.csv", newline="", encoding="utf-8") as f:
        return [{k: _value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def row(table: str, name: str) -> dict:
    """The row of data/<table>.csv whose `name` is `name` (KeyError naming the choices otherwise)."""
    rows = load_table(table)
    for r in rows:
        if r["name"] == name:
            return r
    raise KeyError(f"{name!r} is not in data/{table}.csv; choose one of {[r['name'] for r in rows]}")


def accelerators() -> list[dict]:
    return load_table("accelerators")


def links() -> list[dict]:
    return load_table("links")


def training_runs() -> list[dict]:
    return load_table("training_runs")


def nccl_sweep(name: str = "nccl_allreduce_sweep") -> list[dict]:
    """A published nccl-tests all_reduce sweep (data/<name>.csv), with each row's time recovered from its busbw.

    nccl-tests prints busbw = algbw x 2(n-1)/n and algbw = S / t (doc/PERFORMANCE.md), so t = S x 2(n-1)/n / busbw.
    Adds time_s and algbw_GBps to every row.
    """
    rows = load_table(name)
    for r in rows:
        factor = 2 * (r["gpus"] - 1) / r["gpus"]
        r["algbw_GBps"] = r["busbw_GBps"] / factor
        r["time_s"] = r["size_bytes"] / (r["algbw_GBps"] * GB)
    return rows


def nccl_tests_output(name: str = "nccl_tests_all_reduce_8xH100") -> str:
    """A published nccl-tests output as text (data/<name>.txt): '## ' lines naming its source, then the output as
    posted. Read it with course_lib.measure.nccl_tests.parse (notebook 07)."""
    return (DATA_DIR / f"{name}.txt").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------- memory wall
def weights_bytes(n_params: float, bytes_per_param: float = 4) -> float:
    """Bytes of the weights alone (fp32: 4 bytes each; GPT-3: 175e9 x 4 = 700 GB)."""
    return n_params * bytes_per_param


def training_state_bytes(n_params: float, precision: str = "mixed") -> dict:
    """Weights, gradients and Adam state in bytes, and their total (16 bytes/param; ZeRO, section 3.1)."""
    per = STATE_BYTES_PER_PARAM[precision]
    out = {k: n_params * v for k, v in per.items()}
    out["total"] = sum(out.values())
    return out


def activation_bytes(layers: int, hidden: int, seq_len: int, micro_batch: int, heads: int,
                     recompute: str = "none") -> float:
    """Activations kept for the backward pass of a GPT-style transformer in 16-bit, one GPU, no model parallelism.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", table 2 with t = 1, per
    layer: "none" keeps s b h (34 + 5 a s / h) bytes (eq. 1); "selective" recomputes attention's a s^2 b-sized tensors
    and keeps 34 s b h (section 5); "full" keeps each layer's input, 2 s b h, and reruns its forward pass (lesson 14b).
    """
    s, b, h, a = seq_len, micro_batch, hidden, heads
    per_sbh = {"none": 34 + 5 * a * s / h, "selective": 34, "full": 2}[recompute]
    return layers * s * b * h * per_sbh


def memory_bytes(gpu: dict | str) -> int:
    """Bytes of memory of one accelerator (a row of data/accelerators.csv, or its name).

    The total nvidia-smi reports (memory_MiB_nvidia_smi) where the table has it: A100 80GB 81920 MiB = 85.9e9 bytes,
    H100 SXM 81559 MiB = 85.5e9 bytes. Otherwise the name's size read as GiB, memory_GB x 2**30: an estimate (exact
    for the A100, 0.4% above nvidia-smi on the H100). A program gets a little less: the driver reserves part of the
    total (454 MiB of an H100's, nvidia-smi -q; the H100 row's note).
    """
    gpu = row("accelerators", gpu) if isinstance(gpu, str) else gpu
    if gpu.get("memory_MiB_nvidia_smi"):
        return int(gpu["memory_MiB_nvidia_smi"] * MiB)
    return int(gpu["memory_GB"] * GiB)


def gpus_to_hold(n_bytes: float, gpu: dict | str | float) -> int:
    """How many GPUs of this memory just to hold n_bytes, with perfect sharding and nothing else stored.

    gpu: an accelerator (a row of data/accelerators.csv or its name; its real capacity, memory_bytes()), or a number
    of decimal GB (1e9 bytes) for a what-if.
    """
    capacity = gpu * GB if isinstance(gpu, (int, float)) else memory_bytes(gpu)
    return math.ceil(n_bytes / capacity)


# ---------------------------------------------------------------------------------------------- compute wall
def training_flops(n_params: float, n_tokens: float) -> float:
    """Training FLOPs ~ 6 N D: 2 N per token forward, 4 N backward (Kaplan et al. 2020; Hoffmann et al. 2022)."""
    return 6 * n_params * n_tokens


def flops_per_gpu_from_throughput(n_params: float, tokens_per_s_per_gpu: float) -> float:
    """Achieved FLOP/s per GPU implied by a published token throughput: 6 N x tokens/s."""
    return 6 * n_params * tokens_per_s_per_gpu


def training_time_s(flops: float, gpus: int, peak_TFLOPS: float, mfu: float) -> float:
    """Seconds to do `flops` on `gpus` GPUs each reaching mfu x peak (model-FLOPs utilisation)."""
    return flops / (gpus * peak_TFLOPS * 1e12 * mfu)


def gpu_hours(flops: float, flops_per_gpu_s: float) -> float:
    """GPU-hours to do `flops` at an achieved rate per GPU."""
    return flops / flops_per_gpu_s / 3600


def llama_gpu_hours_check(reference: str = "LLaMA-65B") -> list[dict]:
    """Predict every LLaMA run's GPU-hours from 6ND at the throughput published for `reference` (table 15 vs ours).

    The per-GPU FLOP/s comes from the reference run's tokens/s/GPU (6 N x tokens/s); the other sizes reuse it,
    i.e. assume the same achieved FLOP/s per A100. error = predicted / published - 1; the reference row is marked
    used_to_fit (its own rate is the input, so its agreement is no test), the others are the test of the model.
    """
    runs = [r for r in training_runs() if r["name"].startswith("LLaMA")]
    ref = next(r for r in runs if r["name"] == reference)
    rate = flops_per_gpu_from_throughput(ref["params"], ref["tokens_per_s_per_gpu"])
    peak = row("accelerators", ref["gpu_type"])["bf16_dense_TFLOPS"] * 1e12
    out = []
    for r in runs:
        predicted = gpu_hours(training_flops(r["params"], r["tokens"]), rate)
        out.append({"name": r["name"], "flops": training_flops(r["params"], r["tokens"]),
                    "published_gpu_hours": r["gpu_hours"], "predicted_gpu_hours": predicted,
                    "error": predicted / r["gpu_hours"] - 1, "achieved_TFLOPS": rate / 1e12, "mfu": rate / peak,
                    "used_to_fit": r["name"] == reference})
    return out


# ---------------------------------------------------------------------------------------------- speed formula
def data_parallel_speed(p: int, step_compute_s: float, grad_bytes: float, alpha: float, beta: float,
                        samples_per_step: int = 1) -> dict:
    """Training speed = single-device speed x p x multi-device speedup ratio, the ratio from a ring all-reduce.

    Each of p devices computes a step on its own batch (step_compute_s), then the gradients are all-reduced
    with course_lib.costs.alpha_beta.ring_allreduce (no overlap of compute and communication: the pessimistic case).
    Returns samples/s of one device, of p devices, and the ratio compute / (compute + communication).
    """
    comm = alpha_beta.ring_allreduce(p, grad_bytes, alpha, beta) if p > 1 else 0.0
    single = samples_per_step / step_compute_s
    ratio = step_compute_s / (step_compute_s + comm)
    return {"devices": p, "single_device_speed": single, "speedup_ratio": ratio, "comm_s": comm,
            "speed": single * p * ratio}


def speed_curve(ps, step_compute_s: float, grad_bytes: float, alpha: float, beta: float) -> list[dict]:
    """data_parallel_speed for every device count in ps (weak scaling: the work per device per step is fixed)."""
    return [data_parallel_speed(p, step_compute_s, grad_bytes, alpha, beta) for p in ps]


def scaling(p: int, seq_compute_s: float, grad_bytes: float, alpha: float, beta: float,
            seqs_per_gpu: float | None = None, global_batch: float | None = None) -> dict:
    """Data-parallel speed-up over one device, in weak or strong scaling (no overlap of compute and all-reduce).

    Weak scaling (seqs_per_gpu): every device keeps its batch, so the global batch grows with p. Strong scaling
    (global_batch, in sequences): the global batch is fixed, every device gets global_batch / p of it, so compute
    per step shrinks with p while the all-reduce of the full gradients does not. A device needs at least one
    sequence: beyond p = global_batch data parallelism has nothing left to split (fits = False).
    speed-up = sequences per second on p devices / on one device; efficiency = speed-up / p.
    """
    if (seqs_per_gpu is None) == (global_batch is None):
        raise ValueError("give seqs_per_gpu (weak scaling) or global_batch (strong scaling), not both")
    per_gpu = seqs_per_gpu if seqs_per_gpu is not None else global_batch / p
    comm = alpha_beta.ring_allreduce(p, grad_bytes, alpha, beta) if p > 1 else 0.0
    step = per_gpu * seq_compute_s + comm
    speedup = (p * per_gpu / step) * seq_compute_s   # over one device's 1 / seq_compute_s sequences per second
    return {"devices": p, "seqs_per_gpu": per_gpu, "step_s": step, "comm_s": comm, "fits": per_gpu >= 1,
            "speedup": speedup, "efficiency": speedup / p}


# ---------------------------------------------------------------------------------------------- transfer time
def transfer_time_s(n_bytes: float, link: dict | str) -> float:
    """Seconds to move n_bytes one way over one link: typical latency + n / one-direction bandwidth."""
    link = row("links", link) if isinstance(link, str) else link
    return link["typical_latency_us"] * 1e-6 + n_bytes / (link["GBps_one_direction"] * GB)


def gradient_transfer_table(n_params: float, bytes_per_grad: float = 2) -> list[dict]:
    """Time to send one full copy of the gradients (fp16: 2 bytes each) over every link of data/links.csv."""
    n = n_params * bytes_per_grad
    return [{"link": lk["name"], "kind": lk["kind"], "level": lk["level"], "GBps_one_direction":
             lk["GBps_one_direction"], "seconds": transfer_time_s(n, lk)} for lk in links()]


# ---------------------------------------------------------------------------------------------- a server's topology
# nvidia-smi's PCIe path kinds from closest to farthest: NVML's nvmlGpuTopologyLevel_t numbers them SINGLE 10 (PIX),
# MULTIPLE 20 (PXB), HOSTBRIDGE 30 (PHB), NODE 40, SYSTEM 50 (nvml.h, NVIDIA/go-nvml gen/nvml/nvml.h).
PCIE_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")


def nvidia_smi_topo_text(name: str = "nvidia_smi_topo_8xH100") -> str:
    """A published `nvidia-smi topo -m` output (data/<name>.txt): '## ' lines naming its source, then the output."""
    return (DATA_DIR / f"{name}.txt").read_text(encoding="utf-8")


def parse_nvidia_smi_topo(text: str) -> dict:
    """The matrix, per-GPU CPU/NUMA columns, legend and NIC names of an `nvidia-smi topo -m` output (notebook 02).

    Columns may be tabs or spaces. Returns {"devices", "gpus", "nics", "path": {a: {b: "NV18" | "PIX" | ...}},
    "columns": {gpu: {"CPU Affinity": ..., "NUMA Affinity": ...}}, "legend": {"PIX": "Connection traversing ..."},
    "nic_names": {"NIC0": "mlx5_0"}}; "X" (self) is left out of "path".
    """
    lines = [ln for ln in text.splitlines() if not ln.startswith("##")]
    header = next(i for i, ln in enumerate(lines) if ln[:1].isspace() and ln.split()[:1] == ["GPU0"])
    names = re.split(r"\t+|\s{2,}", lines[header].strip())
    devices = [n for n in names if " " not in n and "Affinity" not in n]
    extra = names[len(devices):]                   # "CPU Affinity", "NUMA Affinity", "GPU NUMA ID" (by version)
    path, columns, legend, nic_names = {}, {}, {}, {}
    section = "matrix"
    for ln in lines[header + 1:]:
        fields = ln.split()
        if ln.strip() in ("Legend:", "NIC Legend:"):
            section = ln.strip()
        elif section == "matrix" and fields and fields[0] in devices:
            cells = fields[1:1 + len(devices)]
            path[fields[0]] = {b: c for b, c in zip(devices, cells) if c != "X"}
            if fields[0].startswith("GPU"):
                columns[fields[0]] = dict(zip(extra, fields[1 + len(devices):]))
        elif section == "Legend:" and (m := re.match(r"\s*(\S+)\s*=\s*(.+?)\s*$", ln)):
            legend[m[1]] = m[2]
        elif section == "NIC Legend:" and (m := re.match(r"\s*(NIC\d+):\s*(\S+)", ln)):
            nic_names[m[1]] = m[2]
    return {"devices": devices, "gpus": [d for d in devices if d.startswith("GPU")],
            "nics": [d for d in devices if not d.startswith("GPU")], "path": path, "columns": columns,
            "legend": legend, "nic_names": nic_names}


def nvidia_smi_topo(name: str = "nvidia_smi_topo_8xH100") -> dict:
    """parse_nvidia_smi_topo of the published output data/<name>.txt."""
    return parse_nvidia_smi_topo(nvidia_smi_topo_text(name))


def closest_nics(topo: dict) -> dict:
    """For every GPU: (the NICs on its shortest PCIe path, that path kind), in PCIE_PATHS order.

    NCCL keeps as a GPU's local NICs those it reaches with the most bandwidth and, among them, the shortest path
    (ncclTopoGetLocal, NCCL src/graph/topo.cc); nvidia-smi shows no bandwidth, so this ranks by the path alone.
    """
    out = {}
    for gpu in topo["gpus"]:
        kinds = {nic: topo["path"][gpu][nic] for nic in topo["nics"] if topo["path"][gpu].get(nic) in PCIE_PATHS}
        if kinds:
            best = min(kinds.values(), key=PCIE_PATHS.index)
            out[gpu] = ([nic for nic, k in kinds.items() if k == best], best)
    return out
