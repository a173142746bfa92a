"""NCCL-rules mode: on gloo ranks, a torch.distributed call that NCCL would refuse, or that would hang there, fails.

``run(fn, 4, nccl_rules=True)``, ``%ranks start 4 --nccl-rules`` or ``COURSE_NCCL_RULES=1`` install it in every rank
after the group is joined; notebooks/04_point_to_point.ipynb teaches it. Each rule below was checked in torch 2.13's
sources (distributed_c10d.py, ProcessGroupNCCL.cpp) or NCCL's documentation; docs/ARCHITECTURE.md lists them with
what the mode does not see. Code that obeys the rules gets the same numbers with and without the mode: the calls
go to gloo unchanged, except that a rank's calls on one group are made to complete in issue order (nccl_order.py)
and send/recv tags are matched in that order, as NCCL does. Groups made with ``new_group(backend="gloo")`` and
launches with an explicit ``backend="gloo"`` are gloo-only by design and left alone.
"""

from __future__ import annotations

import inspect
import os

from .nccl_host import FACTORIES, factory, host_class, made_any
from .nccl_order import Order, Unit, Waited, learner_line
from .nccl_rulebook import BAD_OPS, NCCL_DTYPES, NcclRuleBroken, broken

ENV = "COURSE_NCCL_RULES"

# gloo's reduce-scatter works report is_completed() only once waited for (measured on torch 2.13)
_LAZY_ON_GLOO = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier",
                "all_reduce_coalesced", "all_gather_coalesced", "all_gather_single", "reduce_scatter_single")


class _State:
    rank = 0
    order: Order | None = None
    depth = 0                     # >0 while torch itself calls a collective inside one we wrapped
    original: dict = {}
    gloo_groups: set = set()      # groups made with backend="gloo" on purpose
    first: dict = {}              # group -> name of this rank's first call on it
    timeout = 60.0


def _error(rule: str, detail: str) -> NcclRuleBroken:
    return broken(rule, _State.rank, detail)


def wanted(flag: bool | None, backend: str, chosen: str) -> bool:
    """On for gloo ranks when asked for, or by COURSE_NCCL_RULES=1 unless the cell chose gloo on purpose."""
    if chosen != "gloo" or flag is False:
        return False  # real NCCL ranks need no emulation
    if flag:
        return True
    return os.environ.get(ENV, "") not in ("", "0") and str(backend).lower() != "gloo"


def _dist():
    import torch.distributed as dist

    return dist


def _check_tensors(name: str, tensors) -> None:
    import torch

    host = host_class() if made_any() else None
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if host is not None and isinstance(t, host):
            raise _error("host-tensor", f"dist.{name} got a tensor made on the CPU by {t._made_at}")
        dtype = str(t.dtype).replace("torch.", "")
        if dtype not in NCCL_DTYPES and not t.is_complex():  # torch sends complex tensors as pairs of reals
            raise _error("dtype", f"dist.{name} got a {dtype} tensor")


def _tensors_of(arguments: dict) -> list:
    out = []
    for value in arguments.values():
        if isinstance(value, (list, tuple)):
            out += [v for v in value if hasattr(v, "dtype")]
        elif hasattr(value, "dtype"):
            out.append(value)
    return out


# ---- groups -------------------------------------------------------------------------------------------------------

def _group_info(group):
    dist = _dist()
    g = group if group is not None else dist.group.WORLD
    return g.group_name, dist.get_process_group_ranks(g)


def _left_alone(group) -> bool:
    dist = _dist()
    if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
        return True
    return group is not None and group.group_name in _State.gloo_groups


def _first_call(gname: str, members, name: str) -> None:
    """Rule first-batch: this rank's first call on each group is published; a first batch checks every member's."""
    if gname in _State.first:
        return
    _State.first[gname] = name
    store = _State.order.store
    store.set(f"course_nccl_rules/first/{gname}/{_State.rank}", name)
    if name != "batch_isend_irecv":
        return
    import time

    keys = {m: f"course_nccl_rules/first/{gname}/{m}" for m in members}
    end = time.monotonic() + _State.timeout
    while not all(store.check([k]) for k in keys.values()):
        if time.monotonic() > end:
            missing = [m for m, k in keys.items() if not store.check([k])]
            raise _error("first-batch", f"ranks {missing} made no call on the group within {_State.timeout:.0f} s")
        time.sleep(0.01)
    others = {m: store.get(k).decode() for m, k in keys.items()}
    wrong = {m: n for m, n in others.items() if n != "batch_isend_irecv"}
    if wrong:
        said = ", ".join(f"rank {m} made dist.{n} first" for m, n in sorted(wrong.items()))
        raise _error("first-batch", f"this rank's first call on the group was dist.batch_isend_irecv, but {said}")


# ---- the wrappers ---------------------------------------------------------------------------------------------------

def _collective(name: str, orig):
    sig = inspect.signature(orig)

    def checked(*args, **kwargs):
        if _State.depth:
            return orig(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        a = bound.arguments
        if _left_alone(a.get("group")):
            return orig(*args, **kwargs)
        op = a.get("op")
        if op is not None and getattr(op, "name", str(op)).split(".")[-1] in BAD_OPS:
            raise _error("reduce-op", f"dist.{name} was called with {op}")
        _check_tensors(name, _tensors_of(a))
        gname, members = _group_info(a.get("group"))
        if _State.rank not in members:
            return orig(*args, **kwargs)
        _first_call(gname, members, name)
        order = _State.order
        order.before_post(gname)
        k = order.count(f"c{gname}")
        needs = [(m, f"c{gname}", k) for m in members if m != _State.rank]
        wanted_async = bool(a.get("async_op", False))
        bound.arguments["async_op"] = True
        _State.depth += 1
        try:
            work = orig(*bound.args, **bound.kwargs)
        finally:
            _State.depth -= 1
        order.after_post(gname, Unit([work], needs, f"dist.{name}", learner_line(), lazy=name in _LAZY_ON_GLOO),
                         blocking=not wanted_async)
        return work if wanted_async else None

    checked.__wrapped__ = orig
    return checked


def _p2p(name: str, orig, sending: bool, blocking: bool):
    sig = inspect.signature(orig)

    def checked(*args, **kwargs):
        if _State.depth:
            return orig(*args, **kwargs)
        a = sig.bind(*args, **kwargs).arguments
        group = a.get("group")
        if _left_alone(group):
            return orig(*args, **kwargs)
        dist, side = _dist(), ("dst" if sending else "src")
        peer = a.get(side)
        if a.get(f"group_{side}") is not None:
            peer = dist.get_global_rank(group, a[f"group_{side}"])
        if peer is None:
            raise _error("any-source", f"dist.{name} was called without src")
        tensor = a["tensor"]
        _check_tensors(name, [tensor])
        gname, members = _group_info(group)
        _first_call(gname, members, name)
        order, where, call = _State.order, learner_line(), f"dist.{name}({side}={peer})"
        order.before_post(gname)
        k = order.count(f"{'s' if sending else 'r'}{peer}")
        needs = [(peer, f"{'r' if sending else 's'}{_State.rank}", k)]
        unit = Unit([_post(sending, tensor, peer, group, a.get("tag", 0), k)], needs, call, where)
        if not sending:
            unit.on_done = lambda: _check_tag(peer, k, a.get("tag", 0), call, where)
        order.after_post(gname, unit, blocking)
        if blocking:
            return peer if not sending else None
        return unit.works[0]

    checked.__wrapped__ = orig
    return checked


def _post(sending: bool, tensor, peer: int, group, tag: int, k: int):
    """Post a p2p call with tag 0, so gloo matches a pair's messages in order, as NCCL does; remember the tag."""
    if sending and tag:
        _State.order.store.set(f"course_nccl_rules/tag/{_State.rank}/{peer}/{k}", str(tag))
    post = _State.original["isend" if sending else "irecv"]
    return Waited(post(tensor, peer, group, 0))


def _check_tag(peer: int, k: int, tag: int, call: str, where: str) -> None:
    store, key = _State.order.store, f"course_nccl_rules/tag/{peer}/{_State.rank}/{k}"
    sent = int(store.get(key)) if store.check([key]) else 0
    if sent != tag:
        raise _error("tags", f"{call} with tag={tag} ({where}) received rank {peer}'s message number {k}, "
                     f"which it sent with tag={sent}")


def _batch(orig):
    def checked(p2p_op_list):
        if _State.depth or not p2p_op_list or _left_alone(p2p_op_list[0].group):
            return orig(p2p_op_list)
        dist = _dist()
        gname, members = _group_info(p2p_op_list[0].group)
        _first_call(gname, members, "batch_isend_irecv")
        order, where = _State.order, learner_line()
        order.before_post(gname)
        needs, ops, checks = [], [], []
        for p in p2p_op_list:
            sending = p.op is dist.isend
            _check_tensors("batch_isend_irecv", [p.tensor])
            k = order.count(f"{'s' if sending else 'r'}{p.peer}")
            needs.append((p.peer, f"{'r' if sending else 's'}{_State.rank}", k))
            if sending and p.tag:
                order.store.set(f"course_nccl_rules/tag/{_State.rank}/{p.peer}/{k}", str(p.tag))
            elif not sending:
                checks.append((p.peer, k, p.tag))
            ops.append(dist.P2POp(p.op, p.tensor, p.peer, p.group, 0))
        _State.depth += 1
        try:
            works = [Waited(w) for w in orig(ops)]
        finally:
            _State.depth -= 1
        unit = Unit(works, needs, "dist.batch_isend_irecv", where)
        unit.on_done = lambda: [_check_tag(q, k, t, "dist.batch_isend_irecv", where) for q, k, t in checks]
        order.after_post(gname, unit, blocking=False)
        return works

    checked.__wrapped__ = orig
    return checked


def _monitored_barrier(orig):
    def checked(group=None, *args, **kwargs):
        if not _left_alone(group):
            raise _error("monitored-barrier", "dist.monitored_barrier was called")
        return orig(group, *args, **kwargs)

    checked.__wrapped__ = orig
    return checked


def _new_group(orig):
    def checked(*args, **kwargs):
        group = orig(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        made = group is not None and hasattr(group, "group_name")
        if made and isinstance(backend, str) and backend.lower() == "gloo":
            _State.gloo_groups.add(group.group_name)
        return group

    checked.__wrapped__ = orig
    return checked


def install(rank: int, timeout: float) -> None:
    """Put the rules in force in this rank (after the course joined the group; its own barrier is not counted)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if _State.original:
        return
    _State.rank, _State.timeout = rank, timeout
    _State.order = Order(rank, c10d._get_default_store(), timeout + 5, _error)
    wrapped = {name: _collective(name, getattr(c10d, name)) for name in _COLLECTIVES}
    wrapped.update(send=_p2p("send", c10d.send, True, True), recv=_p2p("recv", c10d.recv, False, True),
                   isend=_p2p("isend", c10d.isend, True, False), irecv=_p2p("irecv", c10d.irecv, False, False),
                   batch_isend_irecv=_batch(c10d.batch_isend_irecv),
                   monitored_barrier=_monitored_barrier(c10d.monitored_barrier), new_group=_new_group(c10d.new_group))
    for name, fn in wrapped.items():
        _State.original[name] = getattr(c10d, name)
        setattr(c10d, name, fn)
        if getattr(dist, name, None) is _State.original[name]:
            setattr(dist, name, fn)
    for name in FACTORIES:
        orig = getattr(torch, name)
        _State.original[f"torch.{name}"] = orig
        setattr(torch, name, factory(name, orig))
