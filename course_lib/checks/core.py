"""The checking machinery every exercise uses: run the learner's function and the reference on the same real ranks.

Each case (world size, tensor size, dtype) is one launch; on every rank the learner's function and the reference
get identical inputs, and the kernel compares what both returned. A difference raises ExerciseFailed with the
case, the rank, what was expected and what came back, and a hint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..launch import run
from ..results import RankFailed, RankTimeout


class ExerciseFailed(AssertionError):
    """The learner's function gave a wrong answer (or failed) on some case; the message says which and why."""


def _fmt(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.tolist()} ({str(t.dtype).replace('torch.', '')}, shape {tuple(t.shape)})"
    return repr(t)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        close = torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)
        return a.shape == b.shape and a.dtype == b.dtype and close
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _both(learner, reference, make_input, size, dtype):
    """Runs on every rank: the reference first (it must not be disturbed by a learner's bug), then the learner's."""
    import torch.distributed as dist

    from course_lib.devices import device

    rank, world = dist.get_rank(), dist.get_world_size()
    want = reference(make_input(rank, world, size, dtype).to(device()))
    got = learner(make_input(rank, world, size, dtype).to(device()))
    return want, got


def check_collective(
    exercise: str,
    learner: Callable,
    reference: Callable,
    make_input: Callable,
    world_sizes: Iterable[int] = (2, 3, 4, 5),
    sizes: Iterable[int] = (1, 7, 12),
    dtypes: Iterable[torch.dtype] = (torch.float32, torch.int64),
    hint: str = "",
    timeout: float = 30.0,
    backend: str = "auto",
) -> None:
    """Compare ``learner(x)`` with ``reference(x)`` on real ranks for every case; print a pass line.

    ``make_input(rank, world_size, size, dtype)`` builds each rank's input; both functions return what the rank
    holds afterwards (a tensor or a list of tensors). Raises ExerciseFailed on the first differing case.
    """
    world_sizes, sizes, dtypes = list(world_sizes), list(sizes), list(dtypes)
    cases = 0
    for world in world_sizes:
        for size in sizes:
            for dtype in dtypes:
                case = f"world_size={world}, size={size}, dtype={str(dtype).replace('torch.', '')}"
                try:
                    res = run(_both, world, args=(learner, reference, make_input, size, dtype), backend=backend,
                              timeout=timeout, output="none")
                except RankFailed as exc:
                    if exc.failure.etype == "NotImplementedError":  # a student copy: the exercise is not done yet
                        raise NotImplementedError(f"{exercise}: {exc.failure.message}") from None
                    what = "did not finish in time (a deadlock?)" if isinstance(exc, RankTimeout) else "failed"
                    why = f"{exercise}: your function {what} with {case}.\n\n{exc}"
                    raise ExerciseFailed(why + (f"\n\nHint: {hint}" if hint else "")) from None
                for rank, (want, got) in enumerate(res.values):
                    if not _same(want, got):
                        raise ExerciseFailed(
                            f"{exercise}: wrong result with {case} on rank {rank}.\n"
                            f"  expected: {_fmt(want)}\n  got:      {_fmt(got)}" + (f"\nHint: {hint}" if hint else "")
                        )
                cases += 1
    line = (f"✓ {exercise} passed: {cases} cases (world sizes {world_sizes}, sizes {sizes}, "
            f"dtypes {[str(d).replace('torch.', '') for d in dtypes]}), every rank matched torch's own result.")
    print(line)
