"""Checker for notebook 15b's exercise 15b.1: causal ring attention on the zig-zag layout, visible halves only.

It runs the learner's function on 2, 3 and 4 real ranks with every collective and the course's own ring attention
switched off (switch_off.py), compares with full causal attention (course_lib.training.ring_attention), and checks
the method: the ring's messages (watch.py: p-1 sends to the next rank, their bytes), the multiply-adds of its
matrix products (the visible half of each arriving block, not the whole block masked), the largest tensor made
(measure/peak_memory.py) and what the tensors hold at once as ranks are added.
"""

from __future__ import annotations

import torch

from .core import ExerciseFailed, passed
from .expert_parallel import _launch

RING = "course_lib.training.ring_attention"
LIBRARY = [f"{RING}.ring_attention", f"{RING}.online_update", f"{RING}.attention"]


def _qkv(p, chunk, d, scale):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2 * p * chunk, d, generator=g, dtype=torch.float64) * s for s in (scale, scale, 1.0)]


def _run_ring(fn, exercise, chunk, d, scales, measure_live):
    """On every rank, for each score scale: the learner's output, its messages, the largest tensor it made and its
    matrix products' multiply-adds; then, if asked, what its tensors held at once."""
    import torch.distributed as dist

    from ..measure.peak_memory import LargestTensor, peak_bytes
    from ..runtime.devices import device
    from ..training.ring_attention import positions
    from .switch_off import switched_off
    from .watch import Watch
    rank, p = dist.get_rank(), dist.get_world_size()
    pos = positions(rank, p, 2 * p * chunk, "zigzag").to(device())
    out = []
    for scale in scales:
        q, k, v = (t.to(device())[pos] for t in _qkv(p, chunk, d, scale))
        with switched_off(exercise, forbid="all", why="passing K and V round a ring", library=LIBRARY):
            with Watch() as w, LargestTensor() as big:
                o = fn(q, k, v)
        out.append({"out": o.cpu() if isinstance(o, torch.Tensor) else o, "record": w.record(),
                    "largest": (big.bytes, big.shape, big.op), "macs": big.macs})
    if not measure_live:
        return {"rank": rank, "scales": out, "live": None}
    q, k, v = (t.to(device())[pos] for t in _qkv(p, chunk, d, scales[0]))
    with switched_off(exercise, forbid="all", why="passing K and V round a ring", library=LIBRARY):
        live = peak_bytes(lambda: fn(q, k, v), device())[1]      # what its tensors held at once, at the peak
    return {"rank": rank, "scales": out, "live": live}


def check_causal_ring_attention(ring_attention_zigzag,
                                exercise: str = "Exercise 15b.1 (causal ring attention, zig-zag)") -> None:
    """`ring_attention_zigzag(q, k, v)` -> this rank's causal attention output, its tokens being chunks r and
    2p-1-r of 2p (positions(rank, p, S, "zigzag")); K/V passed to rank+1 only, p-1 times; no collective. Compared
    with full causal attention in float64 on 2, 3 and 4 ranks, with moderate scores and with scores in the thousands
    (where exp overflows unless the running maximum is subtracted). The method: the matrix products (@, mm, matmul,
    einsum, scaled_dot_product_attention) may do the own block whole (2 c^2 d multiply-adds) and then only the
    visible half of each arriving block (c^2 d each), not the whole block masked (2 c^2 d each); no tensor may exceed
    one c x c block of scores or one stacked K/V pair; what the tensors hold at once may not grow by half a block's
    output (c/2 x d) from 3 to 4 ranks, so neither every rank's keys nor a partial output per block is kept to be
    merged at the end (what the online softmax is for)."""
    from ..training.ring_attention import attention, positions
    from .watch import summary

    hint = ("Chunk numbers decide visibility: you hold chunks r and 2p-1-r, the block from rank s holds chunks s and "
            "2p-1-s. Which of your chunks sees which of its chunks when s < r, and when s > r? Fold what is visible "
            "into those rows' (o, m, den) with the online softmax.")
    chunk, d, scales = 3, 4, (1.0, 20.0)
    c = 2 * chunk
    live, top = {}, 0.0
    for world in (2, 3, 4):
        # memory is compared from 3 to 4 ranks only (below): the profiled run is left out on 2
        vals = _launch(exercise, _run_ring, world, (ring_attention_zigzag, exercise, chunk, d, scales, world > 2), hint)
        if world > 2:
            live[world] = max(v["live"] for v in vals)
        for i, scale in enumerate(scales):
            q, k, v = _qkv(world, chunk, d, scale)
            full = attention(q, k, v, causal=True)
            biggest_score = float((q @ k.T).abs().max() / d ** 0.5)
            top = max(top, biggest_score)
            for rank_val in vals:
                rank, val = rank_val["rank"], rank_val["scales"][i]
                out = val["out"]
                case = f"{world} ranks, rank {rank}, scores up to {biggest_score:,.0f}"
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
                    raise ExerciseFailed(f"{exercise}: {case}: your code made a tensor of shape {list(shape)} "
                                         f"({op}, {biggest} bytes), more than one {c} x {c} block of scores "
                                         f"({c * c * 8} bytes) or one K/V pair (2 x {c} x {d}, {2 * c * d * 8} "
                                         f"bytes). Ring attention never holds a whole row of scores or every rank's "
                                         f"keys, and a product broadcast to (queries x keys x d) is d blocks of "
                                         f"scores: compute scores with a matrix product (q @ k.T) and fold each "
                                         f"block into (o, m, den) as it arrives.\nHint: {hint}")
                # the own block whole (q k^T and p v: 2 c^2 d), then the visible half of each arriving one (c^2 d)
                half, whole = 2 * c * c * d + (world - 1) * c * c * d, 2 * c * c * d * world
                if val["macs"] == 0:
                    raise ExerciseFailed(f"{exercise}: {case}: no matrix product seen; compute the scores and "
                                         f"weights x values with @ (or matmul, einsum, scaled_dot_product_attention), "
                                         f"so that the checker can count the work.\nHint: {hint}")
                if val["macs"] > half:                # whole blocks computed, then sliced, count too
                    raise ExerciseFailed(f"{exercise}: {case}: your matrix products did {val['macs']} multiply-adds; "
                                         f"the own {c} x {c} block and the visible half of each of the {world - 1} "
                                         f"arriving blocks need {half} (whole blocks, masked: {whole}; scores computed "
                                         f"twice count twice). Of a block "
                                         f"from another rank only half the pairs are visible, and they are one "
                                         f"rectangle: compute that product alone, no mask needed.\nHint: {hint}")
    # from 3 ranks on, a ring holds the block it computes on and the one arriving, whatever p is; a rank that keeps
    # something for every block that passed (the block, or a partial output to merge at the end) holds at least a
    # half block's output (c/2 x d float64) more for every rank added
    grow = chunk * d * 8
    if live[4] - live[3] >= grow:
        raise ExerciseFailed(f"{exercise}: your code's tensors held {live[3]} bytes at once on 3 ranks and "
                             f"{live[4]} on 4: {live[4] - live[3]} more for the added rank (at least {grow}, half a "
                             f"block's output, means something is kept per block: the block itself, or a partial "
                             f"output merged at the end). A ring holds the block it works on and the one arriving, "
                             f"however many ranks: fold each block into (o, m, den) and let it go.\nHint: {hint}")
    passed(exercise, f"causal attention of every zig-zag chunk equals full attention on 2, 3 and 4 ranks, with "
                     f"scores up to {top:,.0f}; K/V sent only to the next rank, p-1 times, no collective; matrix "
                     f"products of the own block and the visible half of each other block only; no tensor larger "
                     f"than one block of scores, and memory that does not grow with the ranks")
