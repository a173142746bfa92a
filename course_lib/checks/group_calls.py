"""What exercise 3.1's checker (checks/groups.py, notebook 03) watches on each rank: every collective's group, and
every ``new_group`` call compared across the ranks before it runs."""

from __future__ import annotations

from contextlib import contextmanager

from ..measure.recorder import Recorder


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


class GroupsUsed(Recorder):
    """Every collective a rank runs, however the learner reached it (a view of measure/recorder.py's events)."""

    @property
    def calls(self) -> list[list]:
        """[name, the members of its group, this rank's rank in that group, its reduce op, its element count]."""
        return [[e.collective, e.ranks, e.rank, e.reduce_op, e.numel] for e in self.events]


class GroupsDiffer(RuntimeError):
    """The ranks' k-th new_group calls named different ranks, or some rank never made one (the message says which)."""


@contextmanager
def _compared_calls(case: int, shape: tuple[int, int], wait_s: float):
    """Every new_group call that torch names by count (use_local_synchronization=False) is compared across the
    world before it runs: the k-th call of every rank must name the same ranks. A rank that skips or reorders a
    call fails here at once, with both lists, instead of hanging in a later collective."""
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    store = c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    real, made = c10d.new_group, [0]

    def new_group(ranks=None, *args, **kwargs):
        local = kwargs.get("use_local_synchronization", args[3] if len(args) > 3 else False)
        if not local:
            k = made[0]
            made[0] += 1
            keys = [f"lesson03/{case}/{k}/{r}" for r in range(world)]
            store.set(keys[rank], "all ranks" if ranks is None else f"[{_names(sorted(ranks))}]")
            try:
                store.wait(keys, timedelta(seconds=wait_s))
            except Exception:       # noqa: BLE001 (a store's timeout error differs by store)
                missing = [r for r in range(world) if not store.check([keys[r]])]
                raise GroupsDiffer(
                    f"with {shape[0]} nodes x {shape[1]} GPUs: rank {rank} made its new_group call number {k + 1} "
                    f"(new_group({store.get(keys[rank]).decode()})), but rank(s) {_names(missing)} made no call "
                    f"number {k + 1} within {wait_s:g} s. Every rank calls new_group for every group, even for those "
                    "it is not in: torch names a group by how many groups the rank made before it.") from None
            said = {r: store.get(key).decode() for r, key in enumerate(keys)}
            if len(set(said.values())) > 1:
                listed = "; ".join(f"rank {r}: new_group({v})" for r, v in said.items())
                raise GroupsDiffer(
                    f"with {shape[0]} nodes x {shape[1]} GPUs: the ranks' new_group call number {k + 1} named "
                    f"different ranks ({listed}). torch names a group by how many groups the rank made before it, "
                    "so every rank makes the same groups in the same order, even those it is not in.")
        return real(ranks, *args, **kwargs)

    dist.new_group = c10d.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = c10d.new_group = real
