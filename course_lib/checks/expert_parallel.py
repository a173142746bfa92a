"""Checkers for the exercises of notebooks 15 and 15b: mesh groups, expert-parallel dispatch, causal ring attention.

Each runs the learner's function (on real ranks where it communicates) with the course's own answer and the
collectives the exercise is not about switched off (switch_off.py), compares with the library reference
(course_lib.training.mesh / moe / ring_attention) and checks the method: the groups torch's init_device_mesh
really builds, the split sizes each all-to-all was given (measure/alltoall_log.py), and the ring's messages
(traffic.py: p-1 sends to the next rank, their bytes).
"""

from __future__ import annotations

import torch

from ..measure.c10d_ops import everything_but
from ..runtime.launch import run
from ..runtime.results import RankFailed
from .core import ExerciseFailed, not_attempted, passed

# ------------------------------------------------------------------ shared


def _launch(exercise, fn, world, args, hint):
    try:
        return run(fn, world_size=world, args=args, output="none", timeout=60, nccl_rules=True).values
    except RankFailed as e:
        if e.failure.etype == "NotImplementedError":   # a student copy: the exercise is not done yet
            raise not_attempted(exercise, e.failure.message) from None
        if e.failure.etype == "SwitchedOff":
            raise ExerciseFailed(f"{exercise}: {e.failure.message}\nHint: {hint}") from None
        raise ExerciseFailed(f"{exercise}: rank {e.rank} failed with {world} ranks:\n{e}\nHint: {hint}") from None


# ------------------------------------------------------------------ 15.1 mesh groups

MESH = "course_lib.training.mesh"
REAL_MESHES = [(4, [(2, 2), (4, 1)]), (6, [(2, 3), (3, 2)])]         # (ranks, shapes built by init_device_mesh)
PAPER_MESHES = [(2, 2, 2), (2, 4, 2), (3, 1, 2), (8, 16, 16, 8)]     # the last: Llama 3 128K, (dp, pp, cp, tp)


def _torch_groups(shapes):
    """On every rank: the groups init_device_mesh builds for each shape and dimension (as the ranks report them)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..runtime.devices import device
    out = []
    for shape in shapes:
        mesh = init_device_mesh(device().type, shape)
        out.append([dist.get_process_group_ranks(mesh.get_group(d)) for d in range(len(shape))])
    return out


def _normal(groups):
    return sorted(tuple(int(r) for r in g) for g in groups)


def check_mesh_groups(mesh_groups, exercise: str = "Exercise 15.1 (mesh groups)") -> None:
    """`mesh_groups(shape, dim)` -> the rank groups along mesh dimension `dim` (ranks row-major over `shape`),
    each group in increasing rank order; compared with what init_device_mesh builds on 4 and 6 real ranks, then
    with the library's answer for meshes too big to launch here (Llama 3's 16,384-GPU layout included)."""
    from ..training.mesh import mesh_groups as reference
    from .switch_off import SwitchedOff, switched_off

    hint = ("Picture the ranks laid out on the mesh's shape, numbered like a C array. A group along one dimension: "
            "which coordinates do its ranks share, and how many such groups are there?")

    def mine(shape, dim):
        try:
            with switched_off(exercise, why="laying ranks out on a mesh", library=[f"{MESH}.mesh_groups"]):
                got = mesh_groups(shape, dim)
        except SwitchedOff as e:
            raise ExerciseFailed(f"{exercise}: {e}\nHint: {hint}") from None
        except NotImplementedError as e:
            raise not_attempted(exercise, str(e)) from None
        try:
            return _normal(got), got
        except TypeError:
            raise ExerciseFailed(f"{exercise}: mesh_groups({shape}, {dim}) returned {got!r}; expected a list of "
                                 f"lists of ranks.\nHint: {hint}") from None

    def compare(shape, dim, want, source):
        got, raw = mine(shape, dim)
        if any(list(g) != sorted(g) for g in raw):
            raise ExerciseFailed(f"{exercise}: mesh_groups({shape}, {dim}): list every group in increasing rank "
                                 f"order; got {raw}.")
        if got != want:
            raise ExerciseFailed(f"{exercise}: mesh_groups({shape}, {dim}) gave {sorted(map(list, got))[:6]}"
                                 f"{' ...' if len(got) > 6 else ''}; {source} "
                                 f"{sorted(map(list, want))[:6]}{' ...' if len(want) > 6 else ''}.\nHint: {hint}")

    for world, shapes in REAL_MESHES:
        vals = _launch(exercise, _torch_groups, world, (shapes,), hint)
        for i, shape in enumerate(shapes):
            for dim in range(len(shape)):
                want = _normal({tuple(v[i][dim]) for v in vals})
                compare(shape, dim, want, f"init_device_mesh on {world} real ranks built")
    for shape in PAPER_MESHES:
        for dim in range(len(shape)):
            compare(shape, dim, _normal(reference(shape, dim)), "the groups are")
    passed(exercise, f"every dimension's groups equal init_device_mesh's on 4 and 6 ranks "
                     f"({', '.join(str(s) for _, ss in REAL_MESHES for s in ss)}) and the layout rule for "
                     f"{', '.join(str(s) for s in PAPER_MESHES)}")


# ------------------------------------------------------------------ 15.2 expert-parallel dispatch

N_EXPERTS, D = 6, 2


def _tokens(rank, p):
    """Rank r's tokens: rows r*100 + i (so a misplaced row shows), and their experts. Expert 1 gets no token from
    anyone; rank 0 sends nothing to the last rank (a zero split size both ways)."""
    g = torch.Generator().manual_seed(10 + rank)
    t = 4 + 3 * rank
    per = N_EXPERTS // p
    high = N_EXPERTS - per if rank == 0 else N_EXPERTS
    expert = torch.randint(0, high, (t,), generator=g)
    expert[expert == 1] = 0
    x = (rank * 100 + torch.arange(t, dtype=torch.float32))[:, None] + torch.tensor([0.0, 0.5])
    return x, expert


def _expected_dispatch(rank, p):
    per = N_EXPERTS // p
    rows, counts = [], torch.zeros(p, per, dtype=torch.long)
    for j in range(p):
        x, e = _tokens(j, p)
        order = e.argsort(stable=True)
        x, e = x[order], e[order]
        mine = (e // per) == rank
        rows.append(x[mine])
        counts[j] = torch.bincount(e[mine] - rank * per, minlength=per)
    x, e = _tokens(rank, p)
    to = [int(((e // per) == j).sum()) * D * 4 for j in range(p)]
    return torch.cat(rows), counts, to


def _run_dispatch(fn, exercise):
    import torch.distributed as dist

    from ..measure.alltoall_log import AllToAllLog
    from ..runtime.devices import device
    from .switch_off import switched_off
    rank, p = dist.get_rank(), dist.get_world_size()
    x, e = (t.to(device()) for t in _tokens(rank, p))        # NCCL moves only tensors on the rank's GPU
    with switched_off(exercise, forbid=everything_but("all_to_all"),
                      why="dispatching with all_to_all_single", library=["course_lib.training.moe.ep_forward"]):
        with AllToAllLog() as log:
            got = fn(x, e, N_EXPERTS)
    if isinstance(got, (tuple, list)):
        got = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in got)
    return {"got": got, "calls": [(c.to, c.frm) for c in log.calls], "rank": rank}


def check_dispatch(dispatch, exercise: str = "Exercise 15.2 (expert-parallel dispatch)") -> None:
    """`dispatch(x, expert, n_experts)` -> (rows received, counts): every row of x goes to the rank holding its
    expert (rank r holds experts r*E/p .. (r+1)*E/p - 1), with two all_to_all_single: the counts, then the rows
    with uneven split sizes. Received rows ordered by source rank, then expert, then original order; counts a
    p x E/p tensor (rows from each source for each of my experts). 2 and 3 ranks, zero-size splits included."""
    hint = ("Before all_to_all_single can move rows, every rank must know how many rows it sends to each rank and how "
            "many it will receive. Where do the receive counts come from, and in which order must the rows be?")
    for world in (2, 3):
        vals = _launch(exercise, _run_dispatch, world, (dispatch, exercise), hint)
        for v in vals:
            rank, got = v["rank"], v["got"]
            want_rows, want_counts, want_to = _expected_dispatch(rank, world)
            case = f"{world} ranks, rank {rank}"
            if not (isinstance(got, (tuple, list)) and len(got) == 2):
                raise ExerciseFailed(f"{exercise}: {case}: return (rows received, counts); got {type(got)}.")
            rows, counts = got
            if len(v["calls"]) != 2:
                raise ExerciseFailed(f"{exercise}: {case}: {len(v['calls'])} all_to_all_single calls; expected 2 "
                                     f"(the counts, then the rows).\nHint: {hint}")
            sent_to = v["calls"][1][0]
            if sent_to != want_to:
                raise ExerciseFailed(f"{exercise}: {case}: the rows' all_to_all_single sent {sent_to} bytes to ranks "
                                     f"0..{world - 1}; your rows for rank j's experts are {want_to} bytes.\n"
                                     f"Hint: {hint}")
            if tuple(rows.shape) != tuple(want_rows.shape) or not torch.equal(rows.cpu(), want_rows):
                raise ExerciseFailed(f"{exercise}: {case}: received rows {rows.cpu()[:, 0].tolist()} (first column); "
                                     f"expected {want_rows[:, 0].tolist()} (source rank r sent rows r*100 + i).\n"
                                     f"Hint: {hint}")
            if not torch.equal(torch.as_tensor(counts).cpu().reshape(world, -1).long(), want_counts):
                raise ExerciseFailed(f"{exercise}: {case}: counts {torch.as_tensor(counts).tolist()}; expected "
                                     f"{want_counts.tolist()} (row j: what rank j sent to each of my experts).")
    passed(exercise, "every rank received exactly its experts' rows, in order, on 2 and 3 ranks, with two "
                     "all_to_all_single and the right split sizes (empty splits included)")


# ------------------------------------------------------------------ 15b.1 causal ring attention, zig-zag layout

RING = "course_lib.training.ring_attention"


def _qkv(p, chunk, d, scale):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2 * p * chunk, d, generator=g, dtype=torch.float64) * s for s in (scale, scale, 1.0)]


def _run_ring(fn, exercise, chunk, d, scales):
    """On every rank, for each score scale: the learner's output, its messages and the largest tensor it made."""
    import torch.distributed as dist

    from ..measure.peak_memory import LargestTensor
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
    return {"rank": rank, "scales": out}


def check_causal_ring_attention(ring_attention_zigzag,
                                exercise: str = "Exercise 15b.1 (causal ring attention, zig-zag)") -> None:
    """`ring_attention_zigzag(q, k, v)` -> this rank's causal attention output, its tokens being chunks r and
    2p-1-r of 2p (positions(rank, p, S, "zigzag")); K/V passed to rank+1 only, p-1 times; no collective. Compared
    with full causal attention in float64 on 2 and 3 ranks, with moderate scores and with scores near +-1000
    (where exp overflows unless the running maximum is subtracted). The method: no tensor the learner's code makes
    may exceed one c x c block of scores or one stacked K/V pair, so neither a whole row of scores nor every rank's
    keys ever exist on one rank (what the online softmax is for)."""
    from ..training.ring_attention import attention, positions
    from .traffic import summary

    hint = ("Causal attention lets a query see only keys at or before its global position. Which blocks of the ring "
            "are entirely in a query block's future, and how does the online softmax combine blocks that arrive one by "
            "one?")
    chunk, d, scales = 3, 4, (1.0, 20.0)
    c = 2 * chunk
    for world in (2, 3):
        vals = _launch(exercise, _run_ring, world, (ring_attention_zigzag, exercise, chunk, d, scales), hint)
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
    passed(exercise, "causal attention of every zig-zag chunk equals full attention on 2 and 3 ranks, with "
                     "scores up to ~1000, K/V sent only to the next rank, p-1 times, no collective, and no tensor "
                     "larger than one block of scores")
