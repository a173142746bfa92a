"""Checkers for the exercises of notebooks/05b_collectives_cell_by_cell.ipynb, run on the live %ranks group.

These exercises are about state that stays on the ranks between cells: each rank's weights ``w`` and the
``version`` counter of its changes (5b.1, 5b.2), and gradients accumulated over several cells (5b.3). The check
cell sets that state on every rank, runs the learner's functions on the same persistent ranks, one cell at a time,
with the collectives the exercise does not need switched off (switch_off.py) and every call recorded (watch.py),
then pulls the results back and compares them with values computed here.
"""

from __future__ import annotations

import torch

from ..measure.c10d_ops import everything_but
from ..runtime.rank_failure import clean
from ..runtime.results import RankFailed
from .core import ExerciseFailed, not_attempted, passed, with_hint

_RESULT = "_course_check_result"
# versions per rank (4 ranks): one rank is ahead of all others, at the start, the end and the middle
VERSIONS = ((0, 0, 3, 0), (5, 1, 2, 4), (1, 2, 3, 9), (2, 7, 0, 6))
W_SIZE = 1000          # a w much larger than a version counter, so its bytes tell which collective moved it
WHY = {"newest": ("finding the newest rank from the version counters with all-reduce", ("all_reduce",)),
       "sync": ("bringing every rank to the newest rank's w and version", ("all_reduce", "broadcast")),
       "accumulate": ("accumulating gradients over cells and communicating once per step", ("all_reduce",)),
       "step": ("accumulating gradients over cells and communicating once per step", ("all_reduce",))}


def _versions(world: int, case: int) -> list[int]:
    return [VERSIONS[case][r % 4] + 10 * (r // 4) for r in range(world)]


def _w(rank: int, case: int) -> torch.Tensor:
    return torch.arange(W_SIZE, dtype=torch.float32) * (rank + 1) + 1000 * case


def _grad(rank: int, micro: int) -> torch.Tensor:
    return torch.tensor([rank + 1.0, -2.0 * micro, 0.5 * rank * micro])


# ------------------------------------------------------------------ on every rank
def on_rank(exercise: str, kind: str, ns: dict, case: int = 0) -> None:
    """Runs on each rank, in the namespace of its %%ranks cells: set the state the case needs, run the learner's
    function there watched, and append (result, the state afterwards, traffic record) to ``ns[_RESULT]``."""
    import torch.distributed as dist

    from .core import watched_call

    rank, world, device = dist.get_rank(), dist.get_world_size(), ns["device"]
    why, allowed = WHY[kind]
    if kind in ("newest", "sync"):
        ns["version"] = _versions(world, case)[rank]
        ns["w"] = _w(rank, case).to(device)
    args = (_grad(rank, case).to(device),) if kind == "accumulate" else ()
    got, record = watched_call(exercise, ns[kind], args, forbid=everything_but(*allowed), why=why)
    got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
    state = (ns.get("w").detach().cpu() if isinstance(ns.get("w"), torch.Tensor) else None, ns.get("version"))
    ns.setdefault(_RESULT, []).append((got, state if kind == "sync" else None, record))


# ------------------------------------------------------------------ in the notebook's kernel
def _current(ranks):
    from ..runtime.interactive import current

    ranks = ranks if ranks is not None else current()
    if ranks is None or not ranks.procs:
        raise ExerciseFailed("no ranks are running; start them with %ranks start 4 and run your %%ranks cell first.")
    return ranks


def _group_lost(ranks, exc) -> str:
    """What to do next when the failure broke the group or restarted it (a rank left waiting in a collective)."""
    if not (ranks.broken or "restarted" in getattr(exc, "note", "")):
        return ""
    return (" That left the group unusable: run %ranks restart (unless it was restarted already), rerun your "
            "%%ranks cells (a restart empties every rank's namespace), then run this check again.")


def _run_cell(ranks, exercise: str, kind: str, hint: str, case: int = 0) -> None:
    code = (f"import course_lib.checks.cell_by_cell as _course_check\n"
            f"_course_check.on_rank({exercise!r}, {kind!r}, globals(), {case})\n"
            f"del _course_check")
    try:
        ranks.run_cell(code, show=False)
    except RankFailed as exc:
        f = exc.failure
        if f.etype == "NotImplementedError":
            raise not_attempted(exercise, f.message) from None
        if f.etype == "KeyError" and kind in f.message:
            raise ExerciseFailed(f"{exercise}: the ranks have no {kind}; run your %%ranks cell that defines it "
                                 "first.") from None
        lost = _group_lost(ranks, exc)
        if f.etype == "SwitchedOff":
            said = f"{f.message} (rank {f.rank})" + (f".{lost}" if lost else "")
            raise ExerciseFailed(with_hint(said, hint)) from None
        said = clean(f.message)     # without the C++ source path a gloo message starts with
        raise ExerciseFailed(with_hint(f"{exercise}: your {kind} failed on rank {f.rank}: {f.etype}: {said}"
                                       + (f".{lost}" if lost and not said.endswith(".") else lost), hint)) from None


# the learner's state on the ranks: the checks set their own cases, then give the learner's values back
KEPT = ("w", "version", "acc", "seen")
SAVE = f"_course_kept = {{k: globals()[k] for k in {KEPT!r} if k in globals()}}"
RESTORE = "globals().update(globals().pop('_course_kept', {}))"


def _cases(ranks, run) -> list:
    """``run()`` (the check's cells) between saving and restoring the learner's state; every rank's results."""
    ranks.run_cell(f"globals().pop({_RESULT!r}, None)\n{SAVE}", show=False)
    try:
        run()
        return _results(ranks)
    finally:
        if not ranks.broken and ranks.procs:
            try:
                ranks.run_cell(RESTORE, show=False)
            except RankFailed:      # a rank that cannot run it failed already: the learner sees that failure
                pass


def _results(ranks) -> list:
    """Every rank's list of (result, state, record), one entry per cell run; cleared on the ranks."""
    try:
        return ranks.pull(_RESULT)
    finally:
        ranks.run_cell(f"globals().pop({_RESULT!r}, None)", show=False)


def _calls(record) -> list:
    return [(name, size) for name, size, *_ in record["collectives"]]


def check_newest(ranks=None, exercise: str = "Exercise 5b.1") -> None:
    """``newest()`` on the live ranks: returns, on every rank, the rank whose ``version`` is the highest; only
    all_reduce is on."""
    hint = ("A reduction gives every rank one combined value. Which reduction keeps the highest version, and how can "
            "the combined value, or a second one, also say whose it was?")
    ranks = _current(ranks)
    per_rank = _cases(ranks, lambda: [_run_cell(ranks, exercise, "newest", hint, case)
                                      for case in range(len(VERSIONS))])
    world = len(per_rank)
    for case in range(len(VERSIONS)):
        versions = _versions(world, case)
        want = versions.index(max(versions))
        for rank, rows in enumerate(per_rank):
            got, _, record = rows[case]
            got = got.item() if isinstance(got, torch.Tensor) and got.numel() == 1 else got
            if isinstance(got, bool) or got != want:
                raise ExerciseFailed(with_hint(f"{exercise}: with versions {versions} (rank order), rank {rank}'s "
                                               f"newest() returned {got!r}.", hint))
            calls = _calls(record)
            # the versions must meet in all-reduces of small tensors (a version each, or one slot per rank), not
            # through the process group's store or files
            if not calls or any(size > world * 8 for _, size in calls):
                raise ExerciseFailed(with_hint(
                    f"{exercise}: with versions {versions}, rank {rank}'s newest() ran {calls} (collective, bytes); "
                    f"it finds the newest rank with all-reduces of at most {world} elements (one per rank), and "
                    "with at least one.", hint))
    return passed(exercise, f"every rank named the newest rank for {len(VERSIONS)} sets of versions, with all-reduce "
                            "only")


def check_sync(ranks=None, exercise: str = "Exercise 5b.2") -> None:
    """``sync()`` on the live ranks: afterwards every rank's ``w`` and ``version`` are the newest rank's; w must
    travel once, by broadcast from that rank (all-reduces only of things smaller than w)."""
    hint = ("Which rank holds the weights everyone needs, and which collective copies one rank's tensor to all the "
            "others? What must every rank know before it can call it?")
    ranks = _current(ranks)
    per_rank = _cases(ranks, lambda: [_run_cell(ranks, exercise, "sync", hint, case)
                                      for case in range(len(VERSIONS))])
    world = len(per_rank)
    w_bytes = W_SIZE * 4
    for case in range(len(VERSIONS)):
        versions = _versions(world, case)
        src = versions.index(max(versions))
        for rank, rows in enumerate(per_rank):
            _, (w, version), record = rows[case]
            if w is None or not torch.equal(w, _w(src, case)) or version != versions[src]:
                raise ExerciseFailed(with_hint(
                    f"{exercise}: with versions {versions}, after sync() rank {rank} holds version {version!r} and a "
                    f"w that is {'not a tensor' if w is None else 'not rank ' + str(src) + chr(39) + 's'}.", hint))
            calls = _calls(record)
            moved_w = [c for c in calls if c[1] >= w_bytes]
            reduced = sum(size for name, size in calls if name == "all_reduce")
            # w alone, or w packed with the version (one broadcast of cat([w, version])): under two w's worth; the
            # all-reduces carry only versions or ranks, not w cut into chunks
            if (len(moved_w) != 1 or moved_w[0][0] != "broadcast" or moved_w[0][1] >= 2 * w_bytes
                    or reduced >= w_bytes // 4):
                raise ExerciseFailed(with_hint(
                    f"{exercise}: with versions {versions}, rank {rank} ran {calls} (collective, bytes); w "
                    f"({w_bytes} bytes as float32) must travel in exactly one broadcast of under {2 * w_bytes} bytes "
                    f"(w alone, or packed with the version), and the all-reduces may carry under {w_bytes // 4} "
                    "bytes in all.", hint))
    return passed(exercise, f"every rank held the newest rank's w and version for {len(VERSIONS)} sets of versions, "
                            "w sent once by broadcast")


ROUNDS = (3, 1, 2)      # micro-batches accumulated before each step


def check_accumulate(ranks=None, exercise: str = "Exercise 5b.3") -> None:
    """``accumulate(g)`` and ``step()`` on the live ranks, each call in a cell of its own: step() returns the mean
    of every g accumulated on every rank since the last step; accumulate communicates nothing, step one all_reduce."""
    hint = ("What must each rank keep between cells, and when does it need the other ranks? After a step, what "
            "should the next step start from?")
    ranks = _current(ranks)

    def run():
        # from the state the exercise cell starts with, whatever earlier cells accumulated (saved and given back)
        ranks.run_cell("acc, seen = None, 0", show=False)
        for micro in ROUNDS:
            for i in range(micro):
                _run_cell(ranks, exercise, "accumulate", hint, i)
            _run_cell(ranks, exercise, "step", hint)

    per_rank = _cases(ranks, run)
    world = len(per_rank)
    for rank, rows in enumerate(per_rank):
        at = 0
        for n, micro in enumerate(ROUNDS):
            for i in range(micro):
                if _calls(rows[at + i][2]):
                    raise ExerciseFailed(with_hint(f"{exercise}: rank {rank}'s accumulate ran "
                                                   f"{_calls(rows[at + i][2])} (collective, bytes); it keeps the "
                                                   "gradient on the rank.", hint))
            got, _, record = rows[at + micro]
            want = sum(_grad(r, i) for r in range(world) for i in range(micro)) / (world * micro)
            if [c[0] for c in _calls(record)] != ["all_reduce"]:
                raise ExerciseFailed(with_hint(f"{exercise}: rank {rank}'s step ran {_calls(record)} (collective, "
                                               "bytes); a step makes one all_reduce (pack a count into it if you "
                                               "need one).", hint))
            g_bytes = _grad(rank, 0).numel() * 4
            if _calls(record)[0][1] > 2 * g_bytes:      # one gradient (with a count, perhaps), not every micro-batch's
                raise ExerciseFailed(with_hint(f"{exercise}: rank {rank}'s step all-reduced {_calls(record)[0][1]} "
                                               f"bytes, more than one gradient's {g_bytes}: sum on the rank first, "
                                               "then send one tensor the size of g.", hint))
            if _calls(record)[0][1] < g_bytes:          # the gradient itself travels, not a token beside a side channel
                raise ExerciseFailed(with_hint(f"{exercise}: rank {rank}'s step all-reduced {_calls(record)[0][1]} "
                                               f"bytes, less than one gradient's {g_bytes}: the summed gradient is "
                                               "what the all_reduce carries.", hint))
            if not (isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want)):
                raise ExerciseFailed(with_hint(f"{exercise}: step {n + 1} ({micro} accumulate cell(s) before it) "
                                               f"returned {got!r} on rank {rank}, not the mean of every gradient "
                                               "accumulated since the previous step on every rank.", hint))
            at += micro + 1
    return passed(exercise, f"{len(ROUNDS)} steps after {', '.join(map(str, ROUNDS))} accumulate cells: each step "
                            "returned the mean with one all_reduce, and accumulate sent nothing")
