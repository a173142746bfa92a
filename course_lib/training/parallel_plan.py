"""Memory per GPU and step time of a GPT-style model under data, ZeRO, tensor and pipeline parallelism (notebook 14).

Model states: 2 + 2 + 12 = 16 bytes per parameter in mixed precision with Adam (ZeRO, Rajbhandari et al. SC'20,
section 3.1), the parameters split over tp x pp GPUs, and ZeRO stage 1/2/3 sharding the optimizer state (+ the
gradients, + the 16-bit weights) over the dp replicas (section 5). Activations per transformer layer and micro-batch,
16-bit (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", table 2): none
recomputed sbh(10 + 24/t + 5as/(ht)), with sequence parallelism sbh(34 + 5as/h)/t; selective recomputation
sbh(10 + 24/t), with sequence parallelism 34sbh/t; full recomputation 2sbh (each layer's input) plus one layer's
activations while it is recomputed. Under 1F1B the first stage holds p micro-batches of its L/p layers, i.e. L
layers' worth (section 4.2.3). FLOPs per step: Narayanan et al. SC'21, equation (3): 24·B·s·L·h²·(1 + s/(6h) +
V/(16·L·h)) per forward pass, x3 for forward and backward, x4 with full recomputation. Step time: m micro-batches per
pipeline take (m + p - 1) slots of one micro-batch's compute at `efficiency` x the accelerator's peak, plus tensor
parallelism's all-reduces (4 per layer and micro-batch, 6 with full recomputation; ring on the node's NVLink),
plus the activations sent between stages, plus data parallelism's gradient all-reduce, not overlapped (an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..hardware import STATE_BYTES_PER_PARAM


@dataclass(frozen=True)
class Transformer:
    """A GPT-style model: L layers of hidden size h with a heads, sequence length s, vocabulary V."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    params: float | None = None     # None: 12·L·h² + V·h (Narayanan et al. SC'21, section 5.1)

    @property
    def n_params(self) -> float:
        return self.params or 12 * self.layers * self.hidden ** 2 + self.vocab * self.hidden


@dataclass(frozen=True)
class Layout:
    """How the GPUs are used: tensor x pipeline x data parallel degrees, ZeRO stage, batch and recomputation."""

    tp: int
    pp: int
    dp: int
    micro_batch: int = 1
    global_batch: int = 1024                 # sequences per step
    zero: int = 1
    recompute: str = "selective"             # "none", "selective" or "full"
    sequence_parallel: bool = True

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def microbatches(self) -> int:
        """m: micro-batches each pipeline runs per step."""
        return max(1, self.global_batch // (self.micro_batch * self.dp))


def model_state_bytes(model: Transformer, lay: Layout) -> dict:
    """Bytes of weights, gradients and optimizer state per GPU (mixed precision, ZeRO stage `lay.zero` over dp)."""
    per = STATE_BYTES_PER_PARAM["mixed"]
    psi = model.n_params / (lay.tp * lay.pp)
    sharded = {0: (), 1: ("optimizer",), 2: ("optimizer", "gradients"), 3: ("optimizer", "gradients", "weights")}
    out = {k: per[k] * psi / (lay.dp if k in sharded[lay.zero] else 1) for k in ("weights", "gradients", "optimizer")}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(model: Transformer, lay: Layout, recompute: str | None = None) -> float:
    """Korthikanti et al. 2022, table 2: one layer, one micro-batch, 16-bit, on one tensor-parallel GPU."""
    s, b, h, a, t = model.seq_len, lay.micro_batch, model.hidden, model.heads, lay.tp
    how = recompute or lay.recompute
    attention = 5 * a * s / (h * t)
    if how == "full":
        return 2 * s * b * h
    if lay.sequence_parallel:
        return s * b * h * (34 / t + (attention if how == "none" else 0))
    return s * b * h * (10 + 24 / t + (attention if how == "none" else 0))


def activation_bytes(model: Transformer, lay: Layout) -> float:
    """Activations held by the first pipeline stage under 1F1B: p micro-batches x ceil(L/p) layers (L layers' worth
    when p divides L), and with full recomputation one layer's activations while it is recomputed in backward."""
    kept = lay.pp * -(-model.layers // lay.pp) * activation_bytes_per_layer(model, lay)
    if lay.recompute == "full":
        kept += activation_bytes_per_layer(model, lay, "none")
    return kept


def flops_per_step(model: Transformer, global_batch: int, recompute: str = "selective") -> float:
    """Narayanan et al. SC'21, eq. (3): forward 24·B·s·L·h²·(1 + s/6h + V/16Lh); x3 with backward, x4 when every
    layer's forward runs again in backward (full recomputation; selective recomputation is counted as x3)."""
    s, L, h, V = model.seq_len, model.layers, model.hidden, model.vocab
    forward = 24 * global_batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return forward * (4 if recompute == "full" else 3)


def ring_all_reduce_s(nbytes: float, p: int, gbps_one_direction: float) -> float:
    """Bandwidth term of a ring all-reduce: 2(p-1)/p x S / B (B one direction, per GPU; latency left out)."""
    return 0.0 if p == 1 else 2 * (p - 1) / p * nbytes / (gbps_one_direction * 1e9)


@dataclass
class Cluster:
    """Accelerator (a row of data/accelerators.csv), links (rows of data/links.csv), GPUs per node."""

    accelerator: dict
    intra_link: dict
    inter_link: dict
    gpus_per_node: int = 8
    efficiency: float = 0.5          # the share of peak FLOP/s the matrix multiplies reach
    notes: list = field(default_factory=list)


def step_time(model: Transformer, lay: Layout, cl: Cluster) -> dict:
    """Seconds per step split into compute, pipeline bubble, tensor-parallel, pipeline and data-parallel traffic."""
    m, p, t, d = lay.microbatches, lay.pp, lay.tp, lay.dp
    peak = cl.accelerator["bf16_dense_TFLOPS"] or cl.accelerator["fp16_dense_TFLOPS"]
    work = flops_per_step(model, lay.global_batch, lay.recompute) / lay.gpus
    compute = work / (peak * 1e12 * cl.efficiency)                       # m slots of compute on every GPU
    tp_link = cl.intra_link if t <= cl.gpus_per_node else cl.inter_link
    act = lay.micro_batch * model.seq_len * model.hidden * 2            # one micro-batch's boundary activation
    per_layer = 6 if lay.recompute == "full" else 4
    tp = m * (model.layers / p) * per_layer * ring_all_reduce_s(act, t, tp_link["GBps_one_direction"])
    pp = 0.0 if p == 1 else m * 2 * (act / t) / (cl.inter_link["GBps_one_direction"] * 1e9)
    bubble = (p - 1) / m * (compute + tp + pp)                           # p - 1 more slots of the same length
    grads = 2 * model.n_params / (t * p)                                 # 16-bit gradients of this GPU's part
    dp = ring_all_reduce_s(grads, d, cl.inter_link["GBps_one_direction"]) * (1.5 if lay.zero == 3 else 1.0)
    out = {"compute": compute, "bubble": bubble, "tp_comm": tp, "pp_comm": pp, "dp_comm": dp}
    out["total"] = sum(out.values())
    return out


def plan(model: Transformer, lay: Layout, cl: Cluster) -> dict:
    """Memory per GPU (model states, activations) and step time, with whether it fits the accelerator."""
    states, acts = model_state_bytes(model, lay), activation_bytes(model, lay)
    mem = states["total"] + acts
    return {"layout": lay, "states": states["total"], "activations": acts, "memory": mem,
            "fits": mem <= cl.accelerator["memory_GB"] * 1e9, "time": step_time(model, lay, cl)}


def layouts(model: Transformer, gpus: int, cl: Cluster, base: Layout) -> list[dict]:
    """plan() for every tp (a power of 2 up to the node) x pp (up to the layers) x dp with tp·pp·dp = gpus, other
    fields from `base`; sorted by step time, the ones that fit first."""
    out = []
    for tp in (t for t in (1, 2, 4, 8, 16) if t <= cl.gpus_per_node and gpus % t == 0):
        for pp in (q for q in range(1, model.layers + 1) if gpus % (tp * q) == 0):
            dp = gpus // (tp * pp)
            if base.global_batch % (base.micro_batch * dp) == 0:
                out.append(plan(model, replace(base, tp=tp, pp=pp, dp=dp), cl))
    return sorted(out, key=lambda r: (not r["fits"], r["time"]["total"]))
