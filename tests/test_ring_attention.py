"""Ring attention (notebook 15b): the online softmax folds blocks into exactly softmax(s) v (masked rows included, no
NaN); on 2 and 3 ranks the ring equals full attention (float64, to the reordering bound), causal with contiguous and
zig-zag layouts, overlapped or not; bytes and messages per rank equal the formula exactly; the peak memory per rank
is the formula plus a few row vectors; the causal work is balanced exactly by the zig-zag layout; the overlap
model's crossover; and the exercise checker rejecting an overflowing softmax, a missing rescale, a row of scores
built whole from blocks passed round the ring, and a gathered K/V."""

import math

import pytest
import torch
import torch.distributed as dist

from course_lib import run
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.ring_attention import check_causal_ring_attention
from course_lib.measure.peak_memory import LargestTensor, peak_bytes
from course_lib.measure.traffic import Meter, metered
from course_lib.training.ring_attention import (
    attention,
    causal_pairs,
    crossover,
    memory_formula,
    online_update,
    overlap_model,
    positions,
    ring_attention,
    traffic_formula,
)
from course_lib.training.tolerance import max_diff, sum_atol
from tests.conftest import notebook_function

S, D = 24, 4


def _qkv(s=S, d=D, dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(s, d, generator=g, dtype=dtype) for _ in range(3)]


def test_online_softmax_folds_blocks_into_the_softmax():
    q, k, v = _qkv()
    s = q @ k.T / math.sqrt(D)
    s[:5, 8:] = float("-inf")                       # rows that see nothing in the later blocks
    s[5, :8] = float("-inf")                        # a row that sees nothing in the first block
    o, den = torch.zeros_like(q), torch.zeros(S, dtype=q.dtype)
    m = torch.full((S,), float("-inf"), dtype=q.dtype)
    for j in range(0, S, 8):
        m = online_update(o, m, den, s[:, j:j + 8].clone(), v[j:j + 8])
    assert not torch.isnan(o).any()
    assert max_diff(o / den[:, None], s.softmax(-1) @ v) < sum_atol(2 * S, 10.0, torch.float64)


def _ring_cases():
    rank, p = dist.get_rank(), dist.get_world_size()
    q, k, v = _qkv()
    out = []
    for causal, layout, overlap in [(False, "contiguous", True), (False, "contiguous", False),
                                    (True, "contiguous", True), (True, "zigzag", True)]:
        rows = positions(rank, p, S, layout)
        stats = {}
        with metered(Meter()) as meter:
            o = ring_attention(q[rows], k[rows], v[rows], causal, layout, overlap, stats=stats)
        out.append((o, meter.sent, meter.recv, stats["messages"], stats["blocks"]))
    return out


def test_ring_attention_equals_full_attention_and_sends_the_formula():
    q, k, v = _qkv()
    for p in (2, 3):
        res = run(_ring_cases, world_size=p, output="none", timeout=60)
        for i, (causal, layout) in enumerate([(False, "contiguous")] * 2 + [(True, "contiguous"), (True, "zigzag")]):
            full = attention(q, k, v, causal)
            for r, v_ in enumerate(res.values):
                o, sent, recv, messages, blocks = v_[i]
                assert max_diff(o, full[positions(r, p, S, layout)]) < sum_atol(2 * S, 10.0, torch.float64)
                assert sent == recv == traffic_formula(S, D, p, 8) and messages == p - 1
                if causal and layout == "contiguous":
                    assert blocks == r + 1                # blocks wholly in the future are skipped


def _peak():
    rank, p = dist.get_rank(), dist.get_world_size()
    q, k, v = (t[positions(rank, p, 256)].clone() for t in _qkv(256, 16, torch.float32))
    return peak_bytes(lambda: ring_attention(q, k, v))[1]


def test_peak_memory_per_rank_is_the_formula_plus_row_vectors():
    for p in (1, 2):
        peak = run(_peak, world_size=p, output="none", timeout=60).values[0]
        c, formula = 256 // p, memory_formula(256, 16, p, 4)
        assert 0 <= peak - formula <= 16 * c * 4, (p, peak, formula)


def test_zigzag_balances_causal_work_and_the_crossover():
    for p in (2, 4, 8):
        contiguous, zigzag = causal_pairs(64, p, "contiguous"), causal_pairs(64, p, "zigzag")
        assert sum(contiguous) == sum(zigzag) == 64 * 65 // 2
        assert len(set(zigzag)) == 1 and contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]
    c = crossover(989e12, 450e9, 2)
    assert c == pytest.approx(989e12 / 450e9)                       # bf16: c = F / B (Liu et al. 2023)
    model = overlap_model(c, 128, 989e12, 450e9, 2)
    assert model["compute"] == pytest.approx(model["transfer"]) and model["overlapped"] == model["compute"]
    assert crossover(989e12, 50e9, 2, kv_fraction=8 / 128) == pytest.approx(989e12 / 50e9 / 16)


RIGHT = """
def ring(q, k, v):
    rank, p = dist.get_rank(), dist.get_world_size()
    seq = p * len(q)
    q_pos = positions(rank, p, seq, "zigzag")
    kv = torch.stack([k, v])
    o = torch.zeros_like(q)
    m = torch.full((len(q),), float("-inf"), dtype=q.dtype)
    den = torch.zeros(len(q), dtype=q.dtype)
    for step in range(p):
        src = (rank - step) % p
        if step < p - 1:
            nxt = torch.empty_like(kv)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % p),
                                           dist.P2POp(dist.irecv, nxt, (rank - 1) % p)])
        k_pos = positions(src, p, seq, "zigzag")
        s = (q @ kv[0].T / math.sqrt(q.shape[-1])).masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        if not torch.isinf(s).all():
            m_new = MAX
            scale = RESCALE
            w = torch.exp(s - m_new[:, None])
            o = o * scale[:, None] + w @ kv[1]
            den = den * scale + w.sum(-1)
            m = m_new
        if step < p - 1:
            for req in reqs:
                req.wait()
            kv = nxt
    return o / den[:, None]
"""
GOOD = RIGHT.replace("MAX", "torch.maximum(m, s.amax(-1))").replace("RESCALE", "torch.exp(m - m_new)")
NO_MAX = RIGHT.replace("MAX", "torch.zeros_like(m)").replace("RESCALE", "torch.ones_like(m)")  # exp(s) overflows
NO_RESCALE = RIGHT.replace("MAX", "torch.maximum(m, s.amax(-1))").replace("RESCALE", "torch.ones_like(m)")
COLLECTED = """
def ring(q, k, v):
    rank, p = dist.get_rank(), dist.get_world_size()
    seq = p * len(q)
    kv, blocks = torch.stack([k, v]), []
    for step in range(p):
        blocks.append((kv, positions((rank - step) % p, p, seq, "zigzag")))
        if step < p - 1:
            nxt = torch.empty_like(kv)
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % p),
                                               dist.P2POp(dist.irecv, nxt, (rank - 1) % p)]):
                req.wait()
            kv = nxt
    keys, values = torch.cat([b[0][0] for b in blocks]), torch.cat([b[0][1] for b in blocks])
    k_pos, q_pos = torch.cat([b[1] for b in blocks]), positions(rank, p, seq, "zigzag")
    s = (q @ keys.T / math.sqrt(q.shape[-1])).masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return s.softmax(-1) @ values
"""                                 # the right messages and output, but a whole row of scores at once: no ring method
# online, right messages and output, but it keeps every block that passed
KEPT = GOOD.replace("            kv = nxt", "            kept.append(kv)\n            kv = nxt") \
           .replace("    kv = torch.stack([k, v])", "    kv, kept = torch.stack([k, v]), []")
GATHERED = """
def ring(q, k, v):
    ks = [torch.empty_like(k) for _ in range(dist.get_world_size())]
    dist.all_gather(ks, k)
    return q
"""


def test_ring_checker_passes_the_right_answer_and_names_what_is_wrong(capsys):
    g = {"torch": torch, "dist": dist, "math": math, "positions": positions}
    check_causal_ring_attention(notebook_function(GOOD, "ring", **g))
    assert "✓ Exercise 15b.1" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="NaN or inf"):
        check_causal_ring_attention(notebook_function(NO_MAX, "ring", **g))
    with pytest.raises(ExerciseFailed, match="off by up to"):
        check_causal_ring_attention(notebook_function(NO_RESCALE, "ring", **g))
    with pytest.raises(ExerciseFailed, match=r"made a aten\.\w+ result of shape \[6, 12\]"):
        check_causal_ring_attention(notebook_function(COLLECTED, "ring", **g))
    with pytest.raises(ExerciseFailed, match=r"held 2784 bytes at once on 3 ranks and 3168 on 4: 384 more, one K/V"):
        check_causal_ring_attention(notebook_function(KEPT, "ring", **g))
    with pytest.raises(ExerciseFailed, match="all_gather is switched off"):
        check_causal_ring_attention(notebook_function(GATHERED, "ring", **g))


def test_largest_tensor_counts_results_not_broadcast_views():
    with LargestTensor() as big:
        a = torch.ones(4, 3)
        a[None].expand(100, 4, 3)                      # a view: no new storage
        torch.stack([a, a])
    assert (big.bytes, big.shape, big.op) == (2 * 4 * 3 * 4, (2, 4, 3), "aten.stack")
