"""ZeRO-3's forward with the next layer's all-gather in flight while this layer computes (prefetch), timed on the
emulated link's virtual clock (notebook 12, section 10).

torch's own collectives are not timed by measure/emulated_link.py, so `start_gather` posts an all-gather as the p - 1
point-to-point messages it is made of (every rank sends its shard to every other, rank r to r + j in round j) with
dist.batch_isend_irecv and returns at once, as dist.all_gather_single(..., async_op=True) would; `Gather.wait()`
blocks until every shard has arrived. On the emulated link (one outgoing message at a time per rank, alpha + bytes/B
each) such a gather takes (p - 1)(alpha + shard bytes / B), the ring's time (`gather_seconds`). Compute is charged
a fixed emulated time (emulated_link.compute), so the schedule is the same on every machine. FSDP overlaps the same way:
the next unit's all-gather runs while the current unit computes (Zhao et al. 2023, "PyTorch FSDP", VLDB; on a GPU
on a CUDA stream of its own: FSDPCommContext in torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..measure import emulated_link
from ..measure.memory import padded_rows
from .zero import my_rows

IN_FEATURES = 64     # the digits' 64 pixels: the first layer's input width


def gather_seconds(shard_bytes: int, p: int, link: emulated_link.Link) -> float:
    """Seconds one all-gather of `shard_bytes` per rank holds the link: p - 1 messages, alpha + bytes/B each."""
    return (p - 1) * (link.alpha + shard_bytes / link.bandwidth)


class Gather:
    """An all-gather in flight: its messages, when it was posted, its size, the full padded tensor once waited for."""

    def __init__(self, shard: torch.Tensor):
        rank, p = dist.get_rank(), dist.get_world_size()
        self.parts = [shard if r == rank else torch.empty_like(shard) for r in range(p)]
        ops = [dist.P2POp(dist.isend, shard, (rank + j) % p) for j in range(1, p)]
        ops += [dist.P2POp(dist.irecv, self.parts[(rank - j) % p], (rank - j) % p) for j in range(1, p)]
        self.posted, self.bytes = emulated_link.now(), shard.numel() * shard.element_size()
        self.full_bytes = p * self.bytes           # the gathered (padded) full weight this rank will hold
        self.works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return torch.cat(self.parts)


def start_gather(shard: torch.Tensor) -> Gather:
    """Post this rank's part of an all-gather of `shard` and return at once (wait() gives the full tensor)."""
    return Gather(shard.contiguous())


def sharded_forward(shards, rows, x, compute_s, prefetch: bool, link: emulated_link.Link | None = None):
    """ZeRO-3's forward through row-sharded layers (weight shards `shards`, full rows `rows`), ReLU after each:
    without prefetch layer i+1's all-gather is posted after layer i computed, with prefetch just before. Returns
    (output, events (lane, name, start, end) on this rank's clock, most bytes of full weights alive at once);
    given the emulated `link`, each gather's busy time on it is an event too, checked against the clock."""
    events, peak = [], 0
    pending = start_gather(shards[0])
    for i in range(len(shards)):
        t, held = emulated_link.now(), pending.full_bytes
        w = pending.wait()[:rows[i]]
        events.append(("wait", f"layer {i}'s weight", t, emulated_link.now()))
        if link is not None:    # the link's busy time, as the clock's alpha-beta model gives it
            done = pending.posted + gather_seconds(pending.bytes, dist.get_world_size(), link)
            drift = abs(emulated_link.now() - max(t, done))
            assert drift <= 1e-12 * max(1.0, done), "the clock disagrees with the link"
            events.append(("comm", f"all-gather {i}", pending.posted, done))
        if prefetch and i + 1 < len(shards):
            pending = start_gather(shards[i + 1])
            held += pending.full_bytes              # the next layer arrives while this one is in use
        peak = max(peak, held)
        t = emulated_link.now()
        x = torch.relu(x @ w.T)
        emulated_link.compute(compute_s[i])
        events.append(("compute", f"layer {i}", t, emulated_link.now()))
        if not prefetch and i + 1 < len(shards):
            pending = start_gather(shards[i + 1])
    return x, events, peak


def layers(widths, seed: int = 0, in_features: int = IN_FEATURES):
    """Full weights of a ReLU MLP in_features -> widths[0] -> widths[1] -> ... (no bias), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    dims = [in_features, *widths]
    return [torch.randn(o, i, generator=g) / i ** 0.5 for i, o in zip(dims, dims[1:])]


def forward_times(widths, compute_s, link: emulated_link.Link | str, batch: int = 8, seed: int = 0,
                  in_features: int = IN_FEATURES) -> dict:
    """Run on every gloo rank (on NCCL batch_isend_irecv fuses the messages where the clock cannot see them): the
    same forward without and with prefetch over `link`. Returns each layer's all-gather seconds (measured: the wait
    without prefetch, when nothing else is in flight), both forward times and timelines, the peak bytes of full
    weights, and whether the output equals the unsharded forward (exactly: the same products on the same rows)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    link = emulated_link.link(link) if isinstance(link, str) else link
    full = layers(widths, seed, in_features)
    shards = [my_rows(w, p, rank) for w in full]
    x = torch.randn(batch, in_features, generator=torch.Generator().manual_seed(seed + rank))
    want = x
    for w in full:
        want = torch.relu(want @ w.T)
    out = {"shard_rows": [padded_rows(w.shape[0], p) // p for w in full]}
    for prefetch in (False, True):
        dist.barrier()
        with emulated_link.emulate(link):
            y, events, peak = sharded_forward(shards, [w.shape[0] for w in full], x, compute_s, prefetch, link)
            total = emulated_link.now()
        key = "prefetch" if prefetch else "no_prefetch"
        out[key] = {"seconds": total, "events": events, "peak_bytes": peak, "exact": torch.equal(y, want)}
    out["gather_s"] = [e - s for lane, _, s, e in out["no_prefetch"]["events"] if lane == "wait"]
    return out
