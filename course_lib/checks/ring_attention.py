"""Checker for notebook 15b's exercise 15b.1: causal ring attention on the zig-zag layout.

It runs the learner's function on 2, 3 and 4 real ranks with every collective and the course's own ring attention
switched off (switch_off.py), compares with full causal attention (course_lib.training.ring_attention), and checks
the method: the ring's messages (traffic.py: p-1 sends to the next rank, their bytes), the largest tensor made
(measure/peak_memory.py) and what the tensors hold at once as ranks are added.
"""

from __future__ import annotations

import torch

from .core import ExerciseFailed, passed
from .expert_parallel import _launch

RING = "course_lib.training.ring_attention"


def _qkv(p, chunk, d, scale):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2 * p * chunk, d, generator=g, dtype=torch.float64) * s for s in (scale, scale, 1.0)]


def _run_ring(fn, exercise, chunk, d, scales):
    """On every rank, for each score scale: the learner's output, its messages and the largest tensor it made."""
    import torch.distributed as dist

    from ..measure.peak_memory import LargestTensor, peak_bytes
    from ..runtime.devices import device
    from ..training.ring_attention import positions
    from .switch_off import switched_off
    from .traffic import Watch
    rank, p = dist.get_rank(), dist.get_world_size()
    pos = positions(rank, p, 2 * p * chunk, "zigzag").to(device())
    out = []
    for scale in scales:
        q, k, v = (t.to(device())[pos] for t in _qkv(p, chunk, d, scale))
        with switched_off(exercise, forbid="all", why="passing K and V round a ring",
                          library=[f"{RING}.ring_attention", f"{RING}.online_update", f"{RING}.attention"]):
            with Watch() as w, LargestTensor() as big:
                o = fn(q, k, v)
        out.append({"out": o.cpu() if isinstance(o, torch.Tensor) else o, "record": w.record(),
                    "largest": (big.bytes, big.shape, big.op)})
    q, k, v = (t.to(device())[pos] for t in _qkv(p, chunk, d, scales[0]))
    with switched_off(exercise, forbid="all", why="passing K and V round a ring",
                      library=[f"{RING}.ring_attention", f"{RING}.online_update", f"{RING}.attention"]):
        live = peak_bytes(lambda: fn(q, k, v), device())[1]      # what its tensors held at once, at the peak
    return {"rank": rank, "scales": out, "live": live}


def check_causal_ring_attention(ring_attention_zigzag,
                                exercise: str = "Exercise 15b.1 (causal ring attention, zig-zag)") -> None:
    """`ring_attention_zigzag(q, k, v)` -> this rank's causal attention output, its tokens being chunks r and
    2p-1-r of 2p (positions(rank, p, S, "zigzag")); K/V passed to rank+1 only, p-1 times; no collective. Compared
    with full causal attention in float64 on 2, 3 and 4 ranks, with moderate scores and with scores near +-1000
    (where exp overflows unless the running maximum is subtracted). The method: no tensor the learner's code makes
    may exceed one c x c block of scores or one stacked K/V pair, and what its tensors hold at once may not grow by a
    K/V pair from 3 to 4 ranks, so neither a whole row of scores nor every rank's keys ever exist on one rank (what
    the online softmax is for)."""
    from ..training.ring_attention import attention, positions
    from .traffic import summary

    hint = ("Causal attention lets a query see only keys at or before its global position. Which blocks of the ring "
            "are entirely in a query block's future, and how does the online softmax combine blocks that arrive one by "
            "one?")
    chunk, d, scales = 3, 4, (1.0, 20.0)
    c = 2 * chunk
    live = {}
    for world in (2, 3, 4):
        vals = _launch(exercise, _run_ring, world, (ring_attention_zigzag, exercise, chunk, d, scales), hint)
        live[world] = max(v["live"] for v in vals)
        for i, scale in enumerate(scales):
            q, k, v = _qkv(world, chunk, d, scale)
            full = attention(q, k, v, causal=True)
            for rank_val in vals:
                rank, val = rank_val["rank"], rank_val["scales"][i]
                out = val["out"]
                case = f"{world} ranks, rank {rank}, scores up to {float((q @ k.T).abs().max() / d ** 0.5):.0f}"
                want = full[positions(rank, world, 2 * world * chunk, "zigzag")]
                if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(want.shape):
                    raise ExerciseFailed(f"{exercise}: {case}: return a tensor of shape {tuple(want.shape)} (my "
                                         f"queries x d); got {getattr(out, 'shape', type(out))}.\nHint: {hint}")
                out = out.detach().cpu().double()
                if torch.isnan(out).any() or torch.isinf(out).any():
                    raise ExerciseFailed(f"{exercise}: {case}: your output has NaN or inf in rows "
                                         f"{sorted({int(i) for i in torch.nonzero(~out.isfinite())[:, 0]})}: an "
                                         f"exp overflowed (what keeps exp finite when scores are large?), or a 0/0.\n"
                                         f"Hint: {hint}")
                # float64, the same sums in another order: within ~S * 2^-53 of the values' size, far below 1e-10
                if not torch.allclose(out, want, rtol=0, atol=1e-10):
                    raise ExerciseFailed(f"{exercise}: {case}: off by up to {(out - want).abs().max().item():.3g} "
                                         f"from full causal attention.\nHint: {hint}")
                s = summary(val["record"])
                nxt, sent = (rank + 1) % world, (world - 1) * 2 * c * d * 8
                if s["collectives"]:
                    raise ExerciseFailed(f"{exercise}: {case}: collectives {s['collectives']}; the ring uses "
                                         f"send/recv only.")
                if s["sent_to"] != [nxt] or s["bytes_sent"] != sent:
                    raise ExerciseFailed(f"{exercise}: {case}: you sent {s['bytes_sent']} bytes to ranks "
                                         f"{s['sent_to']}; a ring passes K and V ({c} x {d} float64 each) to rank "
                                         f"{nxt} only, {world - 1} times: {sent} bytes.\nHint: {hint}")
                biggest, shape, op = val["largest"]
                if biggest > max(c * c, 2 * c * d) * 8:
                    raise ExerciseFailed(f"{exercise}: {case}: your code made a {op} result of shape {list(shape)}, "
                                         f"more than one {c} x {c} block of scores or one K/V pair (2 x {c} x {d}). "
                                         f"Ring attention never holds a whole row of scores or every rank's keys: "
                                         f"fold each block into (o, m, den) as it arrives.\nHint: {hint}")
    # from 3 ranks on, a ring holds the block it computes on and the one arriving, whatever p is; a rank that keeps
    # every block that passed holds one more K/V pair for every rank added (2 x c x d float64)
    pair = 2 * c * d * 8
    if live[4] - live[3] >= pair:
        raise ExerciseFailed(f"{exercise}: your code's tensors held {live[3]} bytes at once on 3 ranks and "
                             f"{live[4]} on 4: {live[4] - live[3]} more, one K/V pair ({pair} bytes) for the added "
                             f"rank. A ring holds the block it works on and the one arriving, however many ranks: "
                             f"fold each block into (o, m, den) and let it go.\nHint: {hint}")
    passed(exercise, "causal attention of every zig-zag chunk equals full attention on 2, 3 and 4 ranks, with "
                     "scores up to ~1000, K/V sent only to the next rank, p-1 times, no collective, no tensor "
                     "larger than one block of scores, and memory that does not grow with the ranks")
