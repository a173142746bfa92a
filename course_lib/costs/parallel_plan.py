"""Memory per GPU and step time of a transformer under data, ZeRO, tensor and pipeline parallelism (notebook 14b).

Model states: 2 + 2 + 12 = 16 bytes per parameter in mixed precision with Adam (ZeRO, Rajbhandari et al. SC'20,
section 3.1), the parameters split over tp x pp GPUs, and ZeRO stage 1/2/3 sharding the optimizer state (+ the
gradients, + the 16-bit weights) over the dp replicas (section 5). Activations per transformer layer and micro-batch,
16-bit (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.1 and
table 2): none recomputed sbh(10 + 24/t + 5as/(ht)), with sequence parallelism sbh(34 + 5as/h)/t; selective
recomputation sbh(10 + 24/t), with sequence parallelism 34sbh/t; full recomputation 2sbh (each layer's input) plus
one layer's activations while it is recomputed. The same tensor-by-tensor count is applied to layers that differ from
GPT's (a gated SwiGLU MLP of another width, fewer key/value heads, no dropout), which reproduces table 2 exactly for
GPT's. Under 1F1B the first stage holds p micro-batches of its L/p layers, i.e. L layers' worth (section 4.2.3).
FLOPs per step: Narayanan et al. SC'21, appendix: a layer's matrix multiplies (24·B·s·h² for GPT's) plus 4·B·s²·h of
attention forward, 2·B·s·h·V for the logits; backward twice forward; full recomputation one more forward of the
layers, which is their equation (3), 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)). Step time: m micro-batches per pipeline
take (m + p - 1) slots of one micro-batch's compute at `efficiency` x the accelerator's peak, plus tensor
parallelism's all-reduces (4 per layer and micro-batch, 6 with full recomputation; ring on the node's NVLink), plus
the activations sent between stages, plus data parallelism's gradient traffic in `Layout.grad_bytes` per element
(16-bit by default; Llama 3 reduces in fp32), not overlapped (an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .hardware import STATE_BYTES_PER_PARAM, memory_bytes


@dataclass(frozen=True)
class Transformer:
    """A transformer: L layers of hidden size h with a heads, sequence length s, vocabulary V. The defaults are GPT's
    layer (Korthikanti et al.'s count); `ffn`, `kv_heads`, `gated` and `dropout` describe other layers (Llama 3:
    SwiGLU of width 3.25h, 8 key/value heads, no dropout)."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    params: float | None = None     # None: the layers' matrices and the embedding (12·L·h² + V·h for GPT's layer)
    ffn: int | None = None          # the MLP's width; None: 4h
    kv_heads: int | None = None     # None: as many as query heads; fewer: grouped-query attention
    gated: bool = False             # a SwiGLU MLP (three matrices) instead of GeLU's two
    dropout: bool = True            # GPT keeps dropout masks; a model trained without dropout keeps none

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_share(self) -> float:
        """Key/value heads per query head: 1 for multi-head attention, 8/128 for Llama 3 405B."""
        return (self.kv_heads or self.heads) / self.heads

    @property
    def layer_matrix_params(self) -> float:
        """Weights in one layer's matrix multiplies: Q and output projections h² each, K and V h² x kv_share each,
        the MLP's two (GeLU) or three (SwiGLU) h x ffn matrices."""
        h = self.hidden
        return (2 + 2 * self.kv_share) * h * h + (3 if self.gated else 2) * h * self.ffn_width

    @property
    def n_params(self) -> float:
        return self.params or self.layers * self.layer_matrix_params + self.vocab * self.hidden


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
    first_stage_layers: int | None = None    # None: ceil(L / pp); fewer when a run moves layers off the first stage
    grad_bytes: int = 2                      # bytes per gradient element data parallelism reduces (Llama 3: fp32, 4)

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


def layer_activation_terms(model: Transformer) -> dict:
    """One layer's activations in Korthikanti et al.'s count (section 4.1: 16-bit tensors, 1-byte dropout masks), as
    coefficients: "replicated" and "split" in units of s·b·h bytes (what tensor parallelism leaves whole on every
    rank, and what it divides by t), "scores" in units of a·s²·b bytes. GPT's layer gives 10, 24 and 5."""
    f, kv, drop = model.ffn_width / model.hidden, model.kv_share, 1 if model.dropout else 0
    replicated = 4 + 2 + 2 + 2 * drop          # both norms' inputs, the attention's and the MLP's input, two masks
    attention = 2 + 2 * 2 * kv + 2             # Q, then K and V (fewer heads: smaller), the output projection's input
    mlp = (8 if model.gated else 4) * f        # GeLU: its input, the 2nd Linear's input; SwiGLU: gate, up, SiLU, x
    scores = 2 + 3 * drop                      # softmax output; with dropout its mask and the dropped output
    return {"replicated": replicated, "split": attention + mlp, "scores": scores}


def activation_bytes_per_layer(model: Transformer, lay: Layout, recompute: str | None = None) -> float:
    """Korthikanti et al. 2022, table 2 (for GPT's layer, exactly): one layer, one micro-batch, 16-bit, on one
    tensor-parallel GPU."""
    s, b, h, a, t = model.seq_len, lay.micro_batch, model.hidden, model.heads, lay.tp
    how = recompute or lay.recompute
    if how == "full":
        return 2 * s * b * h
    terms = layer_activation_terms(model)
    scores = terms["scores"] * a * s * s * b / t if how == "none" else 0.0
    if lay.sequence_parallel:
        return s * b * h * (terms["replicated"] + terms["split"]) / t + scores
    return s * b * h * (terms["replicated"] + terms["split"] / t) + scores


def activation_bytes(model: Transformer, lay: Layout) -> float:
    """Activations held by the first pipeline stage under 1F1B: p micro-batches x its layers (ceil(L/p) unless the
    layout says otherwise; L layers' worth when p divides L), and with full recomputation one layer's activations
    while it is recomputed in backward."""
    layers = lay.first_stage_layers or -(-model.layers // lay.pp)
    kept = min(lay.pp, lay.microbatches) * layers * activation_bytes_per_layer(model, lay)
    if lay.recompute == "full":
        kept += activation_bytes_per_layer(model, lay, "none")
    return kept


def flops_per_step(model: Transformer, global_batch: int, recompute: str = "selective") -> float:
    """Narayanan et al. SC'21, appendix: forward of the layers 2·B·s·(their matrices' weights) + 4·B·s²·h each, of
    the logits 2·B·s·h·V; backward twice forward; with full recomputation the layers run forward once more (the logits
    do not), which for GPT's layer is their equation (3), 96·B·s·L·h²·(1 + s/6h + V/16Lh). Selective recomputation's
    few percent (section 5 of Korthikanti et al.: 2.7% for GPT-3) are left out."""
    s, L, h, V, B = model.seq_len, model.layers, model.hidden, model.vocab, global_batch
    layers = L * (2 * B * s * model.layer_matrix_params + 4 * B * s * s * h)
    logits = 2 * B * s * h * V
    return layers * (4 if recompute == "full" else 3) + 3 * logits


def ring_all_reduce_s(nbytes: float, p: int, gbps_one_direction: float) -> float:
    """Bandwidth term of a ring all-reduce: 2(p-1)/p x S / B (B one direction, per GPU; latency left out)."""
    return 0.0 if p == 1 else 2 * (p - 1) / p * nbytes / (gbps_one_direction * 1e9)


@dataclass
class Cluster:
    """Accelerator (a row of data/accelerators.csv), links (rows of data/links.csv), GPUs per node, and how many GPUs
    share one link between nodes (1: a link per GPU, as on a DGX; BLOOM's nodes had 4 links for 8 GPUs: 2)."""

    accelerator: dict
    intra_link: dict
    inter_link: dict
    gpus_per_node: int = 8
    efficiency: float = 0.5          # the share of peak FLOP/s the matrix multiplies reach
    gpus_per_inter_link: float = 1.0
    notes: list = field(default_factory=list)

    @property
    def inter_GBps(self) -> float:
        """One GPU's share of the links between nodes, GB/s in one direction."""
        return self.inter_link["GBps_one_direction"] / self.gpus_per_inter_link


def step_time(model: Transformer, lay: Layout, cl: Cluster) -> dict:
    """Seconds per step split into compute, pipeline bubble, tensor-parallel, pipeline and data-parallel traffic."""
    m, p, t, d = lay.microbatches, lay.pp, lay.tp, lay.dp
    peak = cl.accelerator["bf16_dense_TFLOPS"] or cl.accelerator["fp16_dense_TFLOPS"]
    work = flops_per_step(model, lay.global_batch, lay.recompute) / lay.gpus
    compute = work / (peak * 1e12 * cl.efficiency)                       # m slots of compute on every GPU
    tp_GBps = cl.intra_link["GBps_one_direction"] if t <= cl.gpus_per_node else cl.inter_GBps
    act = lay.micro_batch * model.seq_len * model.hidden * 2            # one micro-batch's boundary activation
    per_layer = 6 if lay.recompute == "full" else 4
    tp = m * (model.layers / p) * per_layer * ring_all_reduce_s(act, t, tp_GBps)
    pp = 0.0 if p == 1 else m * 2 * (act / t) / (cl.inter_GBps * 1e9)   # 1/t each: Megatron's scatter/gather
    bubble = (p - 1) / m * (compute + tp + pp)                           # p - 1 more slots of the same length
    # bytes per parameter of this GPU's part that a ring moves, x (d-1)/d: all-reduce of the gradients (2g); ZeRO-1/2
    # reduce-scatter them (g) and all-gather the 16-bit weights (2); ZeRO-3 gathers them twice (ZeRO, section 7.2)
    g = lay.grad_bytes
    moved = {0: 2 * g, 1: g + 2, 2: g + 2, 3: g + 4}[lay.zero] * model.n_params / (t * p)
    dp = 0.0 if d == 1 else (d - 1) / d * moved / (cl.inter_GBps * 1e9)
    out = {"compute": compute, "bubble": bubble, "tp_comm": tp, "pp_comm": pp, "dp_comm": dp}
    out["total"] = sum(out.values())
    return out


def estimate(model: Transformer, lay: Layout, cl: Cluster) -> dict:
    """Memory per GPU (model states, activations) and step time, with whether it fits the accelerator: its real
    capacity, hardware.memory_bytes (an "80GB" card holds 80 GiB, 85.9e9 bytes for an A100), not memory_GB x 1e9."""
    states, acts = model_state_bytes(model, lay), activation_bytes(model, lay)
    mem = states["total"] + acts
    return {"layout": lay, "states": states["total"], "activations": acts, "memory": mem,
            "fits": mem <= memory_bytes(cl.accelerator), "time": step_time(model, lay, cl)}


def layouts(model: Transformer, gpus: int, cl: Cluster, base: Layout) -> list[dict]:
    """estimate() for every tp (a power of 2 up to the node) x pp (up to the layers) x dp with tp·pp·dp = gpus, other
    fields from `base`; sorted by step time, the ones that fit first."""
    out = []
    for tp in (t for t in (1, 2, 4, 8, 16) if t <= cl.gpus_per_node and gpus % t == 0):
        for pp in (q for q in range(1, model.layers + 1) if gpus % (tp * q) == 0):
            dp = gpus // (tp * pp)
            if base.global_batch % (base.micro_batch * dp) == 0:
                out.append(estimate(model, replace(base, tp=tp, pp=pp, dp=dp), cl))
    return sorted(out, key=lambda r: (not r["fits"], r["time"]["total"]))
