"""Ring attention (notebook 15b): the online softmax folds blocks into exactly softmax(s) v (masked rows included, no
NaN); on 2 and 3 ranks the ring equals full attention (float64, to the reordering bound), causal with contiguous and
zig-zag layouts, overlapped or not; bytes and messages per rank equal the formula exactly; the peak memory per rank
is the formula plus a few row vectors; the causal work is balanced exactly by the zig-zag layout; the overlap
model's crossover, and on the emulated link a step lasting max(compute, transfer) with the send posted first
and their sum without; the exercise checker passing correct solutions written three ways and rejecting a gathered
K/V, an overflowing softmax, a missing rescale, the wrong half, whole blocks masked (twice the multiply-adds), a
partial output or a block kept per rank, a whole row of scores and a broadcast product of scores."""

import math

import pytest
import torch
import torch.distributed as dist

from course_lib import run
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.ring_attention import check_causal_ring_attention
from course_lib.measure import emulated_link
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


def _emulated_steps(bandwidth, flops):
    rank, p = dist.get_rank(), dist.get_world_size()
    q, k, v = (t[positions(rank, p, 64)] for t in _qkv(64, 8, torch.float32))
    out = {}
    for overlap in (True, False):
        stats = {}
        with emulated_link.emulate(emulated_link.Link("test", 0.0, bandwidth)):
            ring_attention(q, k, v, overlap=overlap, flops=flops, stats=stats)
        out[overlap] = stats["step_s"]
    return out


def test_on_the_emulated_link_a_posted_transfer_hides_behind_compute():
    c, d, flops = 32, 8, 1e9
    for bandwidth in (flops / 2, flops / 64):            # crossover c = 4 F / (2 B) = 4 and 128 tokens
        got = run(_emulated_steps, world_size=2, args=(bandwidth, flops), backend="gloo", output="none",
                  timeout=60).values[0]
        model = overlap_model(c, d, flops, bandwidth, elem=4)
        assert got[True][0] == pytest.approx(model["overlapped"], rel=1e-9)
        assert got[False][0] == pytest.approx(model["serial"], rel=1e-9)
        assert got[True][1] == pytest.approx(model["compute"], rel=1e-9)      # the last step sends nothing


# the exercise as intended: the own block masked, then the visible half of each block (MAX, RESCALE filled in)
HALF = """
def ring(q, k, v):
    rank, p = dist.get_rank(), dist.get_world_size()
    h = len(q) // 2
    kv = torch.stack([k, v])
    o = torch.zeros_like(q)
    m = torch.full((len(q),), float("-inf"), dtype=q.dtype, device=q.device)
    den = torch.zeros(len(q), dtype=q.dtype, device=q.device)
    scale = 1 / math.sqrt(q.shape[-1])

    def fold(rows, s, vals):
        m_new = MAX
        r = RESCALE
        w = torch.exp(s - m_new[:, None])
        o[rows] = o[rows] * r[:, None] + w @ vals
        den[rows] = den[rows] * r + w.sum(-1)
        m[rows] = m_new

    for step in range(p):
        src = (rank - step) % p
        if step < p - 1:
            nxt = torch.empty_like(kv)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % p),
                                           dist.P2POp(dist.irecv, nxt, (rank - 1) % p)])
        K, V = kv[0], kv[1]
        if step == 0:
            pos = positions(rank, p, p * len(q), "zigzag").to(q.device)
            s = (q @ K.T * scale).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
            fold(slice(None), s, V)
        elif src < rank:
            fold(slice(None), q @ K[:h].T * scale, V[:h])
        else:
            fold(slice(h, None), q[h:] @ K.T * scale, V)
        if step < p - 1:
            for req in reqs:
                req.wait()
            kv = nxt
    return o / den[:, None]
"""
GOOD = HALF.replace("MAX", "torch.maximum(m[rows], s.amax(-1))").replace("RESCALE", "torch.exp(m[rows] - m_new)")
# exp of raw scores overflows at scores in the thousands
NO_MAX = HALF.replace("MAX", "torch.zeros_like(m[rows])").replace("RESCALE", "torch.ones_like(m_new)")
NO_RESCALE = HALF.replace("MAX", "torch.maximum(m[rows], s.amax(-1))").replace("RESCALE", "torch.ones_like(m_new)")
# the late chunk of an earlier rank instead of its early one: a plausible wrong result
WRONG_HALF = GOOD.replace("q @ K[:h].T * scale, V[:h]", "q @ K[h:].T * scale, V[h:]")
# right numbers, whole blocks masked: twice the work
WHOLE = GOOD.replace("""        elif src < rank:
            fold(slice(None), q @ K[:h].T * scale, V[:h])
        else:
            fold(slice(h, None), q[h:] @ K.T * scale, V)""", """        else:
            kp = positions(src, p, p * len(q), "zigzag").to(q.device)
            qp = positions(rank, p, p * len(q), "zigzag").to(q.device)
            fold(slice(None), (q @ K.T * scale).masked_fill(kp[None, :] > qp[:, None], float("-inf")), V)""")
# the whole block of scores computed, then only the visible half folded in: right numbers, 1.5 times the products
SLICE_AFTER = GOOD.replace("fold(slice(None), q @ K[:h].T * scale, V[:h])",
                           "fold(slice(None), (q @ K.T * scale)[:, :h], V[:h])") \
                  .replace("fold(slice(h, None), q[h:] @ K.T * scale, V)",
                           "fold(slice(h, None), (q @ K.T * scale)[h:], V)")
# every whole block masked, its scores one row at a time (matrix x vector): twice the work, hidden from mm counts
ROWS = WHOLE.replace("(q @ K.T * scale)", "(torch.stack([K @ row for row in q]) * scale)")
# scores as a broadcast product: a (queries x keys x d) tensor, d times a block of scores
BROADCAST = GOOD.replace("fold(slice(None), q @ K[:h].T * scale, V[:h])",
                         "fold(slice(None), (q[:, None, :] * K[None, :h]).sum(-1) * scale, V[:h])")
# online, right messages and output, but it keeps every block that passed
KEPT = GOOD.replace("            kv = nxt", "            kept.append(kv)\n            kv = nxt") \
           .replace("    kv = torch.stack([k, v])", "    kv, kept = torch.stack([k, v]), []")
# log-sum-exp merge (as torch's _SDPAMerger)
LSE = """
def ring(q, k, v):
    rank, p = dist.get_rank(), dist.get_world_size()
    h = len(q) // 2
    kv = torch.stack([k, v])
    out = torch.zeros_like(q)
    lse = torch.full((len(q),), float("-inf"), dtype=q.dtype)
    for step in range(p):
        src = (rank - step) % p
        if step < p - 1:
            nxt = torch.empty_like(kv)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, nxt, (rank - 1) % p),
                                           dist.P2POp(dist.isend, kv, (rank + 1) % p)])
        if step == 0:
            pos = positions(rank, p, p * len(q), "zigzag")
            rows, keys, vals = slice(None), kv[0], kv[1]
            s = torch.einsum("qd,kd->qk", q, keys) / math.sqrt(q.shape[-1])
            s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        else:
            rows, keys, vals = (slice(None), kv[0][:h], kv[1][:h]) if src < rank else (slice(h, None), kv[0], kv[1])
            s = torch.einsum("qd,kd->qk", q[rows], keys) / math.sqrt(q.shape[-1])
        blse = torch.logsumexp(s, -1)
        bout = torch.softmax(s, -1) @ vals
        new = torch.logaddexp(lse[rows], blse)
        out[rows] = out[rows] * torch.exp(lse[rows] - new)[:, None] + bout * torch.exp(blse - new)[:, None]
        lse[rows] = new
        if step < p - 1:
            for r in reqs:
                r.wait()
            kv = nxt
    return out
"""
# blocking send/recv in even/odd order, K and V as two messages, the online softmax on index tensors of rows
BLOCKING = """
def ring(q, k, v):
    rank, p = dist.get_rank(), dist.get_world_size()
    h = len(q) // 2
    K, V = k.clone(), v.clone()
    o = torch.zeros_like(q)
    m = torch.full((len(q),), float("-inf"), dtype=q.dtype)
    den = torch.zeros(len(q), dtype=q.dtype)
    for step in range(p):
        src = (rank - step) % p
        if step == 0:
            pos = positions(rank, p, p * len(q), "zigzag")
            rows = torch.arange(len(q))
            s = torch.matmul(q, K.T).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
            vv = V
        elif src < rank:
            rows, s, vv = torch.arange(len(q)), torch.matmul(q, K[:h].T), V[:h]
        else:
            rows, s, vv = torch.arange(h, len(q)), torch.matmul(q[h:], K.T), V
        s = s / math.sqrt(q.shape[-1])
        m_new = torch.maximum(m[rows], s.amax(-1))
        w = torch.exp(s - m_new[:, None])
        o[rows] = o[rows] * torch.exp(m[rows] - m_new)[:, None] + torch.matmul(w, vv)
        den[rows] = den[rows] * torch.exp(m[rows] - m_new) + w.sum(-1)
        m[rows] = m_new
        if step < p - 1:
            nk, nv = torch.empty_like(K), torch.empty_like(V)
            if rank % 2 == 0:
                dist.send(K, (rank + 1) % p); dist.send(V, (rank + 1) % p)
                dist.recv(nk, (rank - 1) % p); dist.recv(nv, (rank - 1) % p)
            else:
                dist.recv(nk, (rank - 1) % p); dist.recv(nv, (rank - 1) % p)
                dist.send(K, (rank + 1) % p); dist.send(V, (rank + 1) % p)
            K, V = nk, nv
    return o / den[:, None]
"""
# deferred merge: right messages and output, keeps a partial output per block, merged at the end
DEFERRED = """
def ring(q, k, v):
    rank, p = dist.get_rank(), dist.get_world_size()
    h = len(q) // 2
    kv = torch.stack([k, v])
    parts = []
    for step in range(p):
        src = (rank - step) % p
        if step < p - 1:
            nxt = torch.empty_like(kv)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % p),
                                           dist.P2POp(dist.irecv, nxt, (rank - 1) % p)])
        if step == 0:
            pos = positions(rank, p, p * len(q), "zigzag")
            rows, keys, vals = slice(None), kv[0], kv[1]
            s = (q @ keys.T / math.sqrt(q.shape[-1])).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        else:
            rows, keys, vals = (slice(None), kv[0][:h], kv[1][:h]) if src < rank else (slice(h, None), kv[0], kv[1])
            s = q[rows] @ keys.T / math.sqrt(q.shape[-1])
        mb = s.amax(-1)
        w = torch.exp(s - mb[:, None])
        parts.append((rows, mb, w @ vals, w.sum(-1)))
        if step < p - 1:
            for r in reqs:
                r.wait()
            kv = nxt
    m = torch.full((len(q),), float("-inf"), dtype=q.dtype)
    for rows, mb, _, _ in parts:
        m[rows] = torch.maximum(m[rows], mb)
    o, den = torch.zeros_like(q), torch.zeros(len(q), dtype=q.dtype)
    for rows, mb, num, l in parts:
        f = torch.exp(mb - m[rows])
        o[rows] += num * f[:, None]
        den[rows] += l * f
    return o / den[:, None]
"""
# the right messages and output, but a whole row of scores at once: no ring method
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
"""
# the shortcut: a collective
GATHERED = """
def ring(q, k, v):
    ks = [torch.empty_like(k) for _ in range(dist.get_world_size())]
    dist.all_gather(ks, k)
    return q
"""


def _check(src):
    g = {"torch": torch, "dist": dist, "math": math, "positions": positions}
    check_causal_ring_attention(notebook_function(src, "ring", **g))


def test_ring_checker_passes_correct_solutions_written_differently(capsys):
    # the online softmax; a log-sum-exp merge with einsum; blocking send/recv with K and V as two messages
    for src in (GOOD, LSE, BLOCKING):
        _check(src)
        assert "✓ Exercise 15b.1" in capsys.readouterr().out


def test_ring_checker_refuses_the_shortcut_and_wrong_results():
    with pytest.raises(ExerciseFailed, match="all_gather is switched off"):
        _check(GATHERED)
    with pytest.raises(ExerciseFailed, match="NaN or inf"):
        _check(NO_MAX)
    with pytest.raises(ExerciseFailed, match="off by up to"):
        _check(NO_RESCALE)
    with pytest.raises(ExerciseFailed, match="off by up to"):
        _check(WRONG_HALF)


def test_ring_checker_refuses_a_wrong_method_with_the_right_numbers():
    with pytest.raises(ExerciseFailed, match=r"did 576 multiply-adds; .* need 432 \(whole blocks, masked: 576"):
        _check(WHOLE)
    with pytest.raises(ExerciseFailed, match=r"did 504 multiply-adds; .* need 432"):
        _check(SLICE_AFTER)
    with pytest.raises(ExerciseFailed, match=r"did \d+ multiply-adds; .* need 432"):
        _check(ROWS)
    with pytest.raises(ExerciseFailed, match=r"held \d+ bytes at once on 3 ranks and \d+ on 4: 288 more"):
        _check(DEFERRED)
    with pytest.raises(ExerciseFailed, match=r"held \d+ bytes at once on 3 ranks and \d+ on 4: 384 more"):
        _check(KEPT)
    with pytest.raises(ExerciseFailed, match=r"made a tensor of shape \[6, 12\] \(aten\.mm"):
        _check(COLLECTED)
    with pytest.raises(ExerciseFailed, match=r"made a tensor of shape \[6, 3, 4\] \(aten\.mul"):
        _check(BROADCAST)


def test_largest_tensor_counts_results_not_broadcast_views():
    with LargestTensor() as big:
        a = torch.ones(4, 3)
        a[None].expand(100, 4, 3)                      # a view: no new storage
        torch.stack([a, a])
    assert (big.bytes, big.shape, big.op) == (2 * 4 * 3 * 4, (2, 4, 3), "aten.stack")


def test_largest_tensor_counts_the_multiply_adds_of_matrix_products():
    q, k = torch.randn(6, 4), torch.randn(3, 4)
    with LargestTensor() as big:
        q @ k.T                                        # mm: 6 x 3 x 4
        torch.einsum("qd,kd->qk", q, k)               # bmm underneath: the same
        torch.nn.functional.scaled_dot_product_attention(q[None], k[None], k[None])   # q k^T and p v: twice
        k @ q[0]                                       # mv: 3 x 4
        q[0] @ q[1]                                    # dot: 4
        q * 2                                          # not a product of matrices
    assert big.macs == 72 + 72 + 144 + 12 + 4
