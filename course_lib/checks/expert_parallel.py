"""Checkers for notebook 15's exercises: mesh groups and the exchange's backward (15b.1: checks/ring_attention.py).

Each runs the learner's function (on real ranks where it communicates) with the course's own answer, torch's
ready-made one (its private mesh layout; its differentiable all-to-alls) and the collectives the exercise is not
about switched off (switch_off.py), compares with the library reference (course_lib.training.mesh / moe) and checks
the method: the groups torch's init_device_mesh really builds, and the bytes each all-to-all moved forward (the
routed rows, no padding) and back (measure/alltoall_log.py, which also sees torch's functional all-to-all).
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
# torch's private layout arithmetic, which init_device_mesh builds its groups with: the answer by another name
TORCH_LAYOUT = ["torch.distributed._mesh_layout._FlatLayout.all_ranks_from_zero",
                "torch.distributed._mesh_layout._FlatLayout.global_ranks",
                "torch.distributed._mesh_layout._MeshLayout.remap_to_tensor"]
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


def _plainly(message: str, names: dict[str, str]) -> str:
    """switch_off names a stubbed torch function "dist.<its last name>"; say which function it really is."""
    for stub, real in names.items():
        message = message.replace(f"{stub} is switched off", f"{real} is switched off")
    return message


_LAYOUT_NAMES = {f"dist.{p.rsplit('.', 1)[1]}": "torch's private mesh layout (torch.distributed._mesh_layout, "
                 "what init_device_mesh computes its groups with)" for p in TORCH_LAYOUT}


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
            with switched_off(exercise, why="laying ranks out on a mesh",
                              library=[f"{MESH}.mesh_groups", *TORCH_LAYOUT]):
                got = mesh_groups(shape, dim)
        except SwitchedOff as e:
            raise ExerciseFailed(f"{exercise}: {_plainly(str(e), _LAYOUT_NAMES)}\nHint: {hint}") from None
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
# torch's differentiable all-to-alls: in torch 2.13 the functional all_to_all_single has a backward of its own
TORCH_AUTOGRAD_A2A = ["torch.distributed.nn.functional.all_to_all_single",
                      "torch.distributed.nn.functional._AlltoAllSingle.forward",
                      "torch.distributed._functional_collectives.all_to_all_single",
                      "torch.distributed._functional_collectives.all_to_all_single_autograd"]
_A2A_NAMES = {"dist.forward": "torch.distributed.nn.functional._AlltoAllSingle (torch's differentiable all-to-all)",
              "dist.all_to_all_single": "torch's differentiable all-to-all (torch.distributed.nn.functional's or "
                                        "_functional_collectives' all_to_all_single)",
              "dist.all_to_all_single_autograd": "torch's _functional_collectives.all_to_all_single_autograd"}


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
                      library=[f"{MOE}._exchange", *TORCH_AUTOGRAD_A2A]):
        with AllToAllLog() as fwd:
            y = ep_forward(x, layer, exchange=exchange_cls.apply)
        with AllToAllLog() as bwd:
            (y * c).sum().backward()
    return {"rank": rank, "x_grad": None if x.grad is None else x.grad.cpu(),
            "grads": {n: q.grad.cpu() for n, q in layer.named_parameters() if q.grad is not None},
            "fwd": [(e.to, e.frm, e.via) for e in fwd.calls], "bwd": [(e.to, e.frm, e.via) for e in bwd.calls]}


def _routed_bytes(layer, world):
    """bytes[r][j]: what rank r's dispatch must send rank j, from the single-process routing of every rank's tokens."""
    per, row = LAYER["n_experts"] // world, LAYER["d"] * 8
    with torch.no_grad():
        dest = [layer.route(_tokens_and_weights(r)[0]).expert // per for r in range(world)]
    return [[int((dest[r] == j).sum()) * row for j in range(world)] for r in range(world)]


def _check_traffic(v, want, world, exercise, hint):
    """One rank's logged all-to-alls: dist.all_to_all_single only, 3 forward and 2 backward, the dispatch moving
    exactly the routed rows, the combine its reverse, and each backward its forward reversed."""
    case = f"{world} ranks, rank {v['rank']}"
    if any(via != "c10d" for *_, via in v["fwd"] + v["bwd"]):
        raise ExerciseFailed(f"{exercise}: {case}: your exchange reached torch's functional all_to_all_single "
                             f"(torch.ops._c10d_functional), which brings torch's own backward; call "
                             f"dist.all_to_all_single in forward and in backward.\nHint: {hint}")
    if len(v["fwd"]) != 3:
        raise ExerciseFailed(f"{exercise}: {case}: the layer's forward made {len(v['fwd'])} dist.all_to_all_single "
                             f"calls; the counts, the dispatch and the combine make 3, so your forward should make "
                             f"exactly one.\nHint: {hint}")
    r = v["rank"]
    sent, got = want[r], [want[j][r] for j in range(world)]
    for (to, frm, _), (wto, wfrm), name in ((v["fwd"][1], (sent, got), "dispatch"),
                                            (v["fwd"][2], (got, sent), "combine")):
        if to != wto or frm != wfrm:
            raise ExerciseFailed(f"{exercise}: {case}: your forward, as the {name}, sent {to} bytes to ranks "
                                 f"0..{world - 1} and received {frm}; the routing moves {wto} and {wfrm} (rows of "
                                 f"{LAYER['d']} float64 values): one exchange of exactly the rows the splits say, "
                                 f"no padding.\nHint: {hint}")
    if len(v["bwd"]) != 2:
        raise ExerciseFailed(f"{exercise}: {case}: backward made {len(v['bwd'])} all_to_all_single calls for "
                             f"the layer's 2 exchanges; each exchange's backward is one exchange.\nHint: {hint}")
    for (to, frm, _), (fto, ffrm, _), name in ((v["bwd"][0], v["fwd"][2], "combine"),
                                               (v["bwd"][1], v["fwd"][1], "dispatch")):
        if to != ffrm or frm != fto:
            raise ExerciseFailed(f"{exercise}: {case}: the {name}'s backward sent {to} bytes to ranks "
                                 f"0..{world - 1} and received {frm}; its forward received {ffrm} and sent "
                                 f"{fto}.\nHint: {hint}")


def check_exchange(exchange_cls, exercise: str = "Exercise 15.2 (the exchange's backward)") -> None:
    """`exchange_cls`, a torch.autograd.Function: apply(rows, out_splits, in_splits) moves rows with one
    dist.all_to_all_single and its backward sends the gradients back. Plugged into the expert-parallel MoE (dispatch
    and combine, top-2, 6 experts, uneven tokens per rank) on 2 and 3 ranks: the gradients of every rank's tokens,
    of the experts and of the gate (summed over ranks, as data parallelism's all-reduce would) equal single-process
    autograd; each forward exchange moves exactly the routed rows and each backward is one all_to_all_single moving
    them back. torch's differentiable all-to-alls and the course's own exchange are off."""
    from ..training.moe import MoE

    hint = ("In forward, in_splits[j] rows went to rank j and out_splits[j] rows came from rank j. Where must the "
            "gradient of each row that arrived go, and how many gradient rows does each rank get back?")
    for world in (2, 3):
        try:
            vals = _launch(exercise, _run_exchange, world, (exchange_cls, exercise), hint)
        except ExerciseFailed as e:
            raise ExerciseFailed(_plainly(str(e), _A2A_NAMES)) from None
        layer = MoE(**LAYER)                                  # the single-process reference, same weights
        want = _routed_bytes(layer, world)
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
            _check_traffic(v, want, world, exercise, hint)
            got = v["x_grad"]
            wanted = xs[v["rank"]].grad
            if got is None or tuple(got.shape) != tuple(wanted.shape) or (got - wanted).abs().max() > atol:
                diff = "no gradient" if got is None else f"off by {(got - wanted).abs().max().item():.3g}"
                raise ExerciseFailed(f"{exercise}: {world} ranks, rank {v['rank']}: the gradient of this rank's "
                                     f"tokens is {diff} against single-process autograd.\nHint: {hint}")
        for name, q in layer.named_parameters():
            got = sum(v["grads"][name] for v in vals if name in v["grads"])   # each expert on its rank; gate summed
            if not isinstance(got, torch.Tensor) or (got - q.grad).abs().max() > atol:
                raise ExerciseFailed(f"{exercise}: {world} ranks: the gradient of {name} differs from single-process "
                                     f"autograd.\nHint: {hint}")
    passed(exercise, "the expert-parallel layer's gradients (tokens, experts, gate summed over ranks) equal "
                     "single-process autograd on 2 and 3 ranks; each exchange moves exactly the routed rows, and "
                     "each backward is one all_to_all_single moving them back")
