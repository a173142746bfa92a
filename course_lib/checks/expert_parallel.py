"""Checkers for the exercises of notebooks 15 and 15b: mesh groups, the exchange's backward, causal ring attention.

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


# ------------------------------------------------------------------ 15.2 the exchange autograd goes through

MOE = "course_lib.training.moe"
LAYER = dict(d=4, hidden=8, n_experts=6, k=2, capacity_factor=None)
TORCH_AUTOGRAD_A2A = ["torch.distributed.nn.functional.all_to_all_single",
                      "torch.distributed.nn.functional._AlltoAllSingle.forward",
                      "torch.distributed._functional_collectives.all_to_all_single_autograd"]


def _tokens_and_weights(rank):
    """Rank r's tokens (3 + 4r of them: uneven splits, some empty at 3 ranks) and the loss's weights for them."""
    g = torch.Generator().manual_seed(50 + rank)
    n = 3 + 4 * rank
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 4, generator=g, dtype=torch.float64)


def _run_exchange(exchange_cls, exercise):
    """On every rank: the expert-parallel layer with the learner's exchange, forward and backward, logged."""
    import torch.distributed as dist

    from ..measure.alltoall_log import AllToAllLog
    from ..runtime.devices import device
    from ..training.moe import MoE, ep_forward
    from .switch_off import switched_off
    rank = dist.get_rank()
    layer = MoE(**LAYER).to(device())
    x, c = (t.to(device()) for t in _tokens_and_weights(rank))
    x.requires_grad_(True)
    with switched_off(exercise, forbid=everything_but("all_to_all"), why="the exchange's backward",
                      library=[f"{MOE}.ExchangeRows.forward", f"{MOE}.ExchangeRows.backward", *TORCH_AUTOGRAD_A2A]):
        with AllToAllLog() as fwd:
            y = ep_forward(x, layer, exchange=exchange_cls.apply)
        with AllToAllLog() as bwd:
            (y * c).sum().backward()
    return {"rank": rank, "x_grad": None if x.grad is None else x.grad.cpu(),
            "grads": {n: q.grad.cpu() for n, q in layer.named_parameters() if q.grad is not None},
            "fwd": [(e.to, e.frm) for e in fwd.calls], "bwd": [(e.to, e.frm) for e in bwd.calls]}


def check_exchange(exchange_cls, exercise: str = "Exercise 15.2 (the exchange's backward)") -> None:
    """`exchange_cls`, a torch.autograd.Function: apply(rows, out_splits, in_splits) moves rows with one
    all_to_all_single and its backward sends the gradients back. Plugged into the expert-parallel MoE (dispatch and
    combine, top-2, 6 experts, uneven tokens per rank) on 2 and 3 ranks: the gradients of every rank's tokens, of
    the experts and of the gate equal single-process autograd; backward makes one all_to_all_single per exchange,
    each moving exactly the bytes its forward moved, the other way. torch's differentiable all-to-alls are off."""
    from ..training.moe import MoE

    hint = ("In forward, in_splits[j] rows went to rank j and out_splits[j] rows came from rank j. Where must the "
            "gradient of each row that arrived go, and how many gradient rows does each rank get back?")
    for world in (2, 3):
        vals = _launch(exercise, _run_exchange, world, (exchange_cls, exercise), hint)
        layer = MoE(**LAYER)                                  # the single-process reference, same weights
        xs = []
        total = 0.0
        for r in range(world):
            x, c = _tokens_and_weights(r)
            xs.append(x.requires_grad_(True))
            total = total + (layer(x) * c).sum()
        total.backward()
        # float64, the same products summed in another order (at most ~50 terms of size < 10): far below 1e-12
        atol = 1e-12
        for v in vals:
            case = f"{world} ranks, rank {v['rank']}"
            if len(v["fwd"]) != 3:
                raise ExerciseFailed(f"{exercise}: {case}: the layer's forward made {len(v['fwd'])} all_to_all_single "
                                     f"calls; the counts, the dispatch and the combine make 3: your forward should "
                                     f"make exactly one.\nHint: {hint}")
            if len(v["bwd"]) != 2:
                raise ExerciseFailed(f"{exercise}: {case}: backward made {len(v['bwd'])} all_to_all_single calls for "
                                     f"the layer's 2 exchanges; each exchange's backward is one exchange.\n"
                                     f"Hint: {hint}")
            for (to, frm), (fto, ffrm), name in ((v["bwd"][0], v["fwd"][2], "combine"),
                                                 (v["bwd"][1], v["fwd"][1], "dispatch")):
                if to != ffrm or frm != fto:
                    raise ExerciseFailed(f"{exercise}: {case}: the {name}'s backward sent {to} bytes to ranks "
                                         f"0..{world - 1} and received {frm}; its forward received {ffrm} and sent "
                                         f"{fto}.\nHint: {hint}")
            got = v["x_grad"]
            want = xs[v["rank"]].grad
            if got is None or tuple(got.shape) != tuple(want.shape) or (got - want).abs().max() > atol:
                diff = "no gradient" if got is None else f"off by {(got - want).abs().max().item():.3g}"
                raise ExerciseFailed(f"{exercise}: {case}: the gradient of this rank's tokens is {diff} against "
                                     f"single-process autograd.\nHint: {hint}")
        for name, q in layer.named_parameters():
            got = sum(v["grads"][name] for v in vals if name in v["grads"])   # each expert on its rank; gate summed
            if not isinstance(got, torch.Tensor) or (got - q.grad).abs().max() > atol:
                raise ExerciseFailed(f"{exercise}: {world} ranks: the gradient of {name} differs from single-process "
                                     f"autograd.\nHint: {hint}")
    passed(exercise, "the expert-parallel layer's gradients (tokens, experts, gate) equal single-process autograd on "
                     "2 and 3 ranks, and each backward is one all_to_all_single moving its forward's bytes back")


# ------------------------------------------------------------------ 15b.1 causal ring attention, zig-zag layout

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
