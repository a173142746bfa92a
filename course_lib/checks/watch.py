"""What each rank sent while a checker watched: messages, bytes, peers, collective calls and rounds.

``with Watch() as log:`` records, on one rank, every point-to-point message (dist.send/recv/isend/irecv,
batch_isend_irecv, the ProcessGroup object: all end in c10d::send / c10d::recv_) and every collective call
(name, bytes, group size), at the dispatcher like switch_off.py: Watch is a view of measure/recorder.py's events that
also follows each message's Work to the moment its wait() returns. ``log.record()`` is a plain dict the checker
brings back from every rank; ``summary(records)`` and ``rounds(records)`` turn them into the figures an
algorithm is judged by (a ring all-reduce: 2(p-1) messages of n/p per rank in 2(p-1) rounds, Patarasuk & Yuan
2009; taught in notebooks/06_build_your_own_collectives.ipynb).

Rounds are the longest chain of messages each of which could only be sent after the one before it arrived: a
send depends on the receives this rank had completed (``wait()`` returned, or a blocking recv) before posting it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..measure.recorder import Recorder


class Watch(Recorder):
    """``with Watch() as log:`` records this rank's messages and collective calls inside the block."""

    def __init__(self):
        super().__init__()
        self.sends: list[list] = []        # [peer, bytes, receives completed before it was posted]
        self.recvs: list[list] = []        # [peer, bytes]
        self.completed: list[int] = []     # indices into recvs, in the order their wait() returned
        self.groups: list = []             # the ranks of every dist.new_group this rank called (None: all)
        self._pending: dict[int, tuple] = {}   # id(Work) -> ("recv", index) or ("send", None)
        self._saved_wait = None

    @property
    def collectives(self) -> list[list]:
        """[name, bytes of the largest tensor argument, group size, reduce op or None, elements] per call."""
        return [[e.collective, e.nbytes, e.p, e.reduce_op, e.numel] for e in self.events if e.kind == "collective"]

    # -------------------------------------------------------------- the dispatcher side (recorder.py)
    def recorded(self, seen, out, args) -> None:
        if seen.kind == "send":
            self.sends.append([seen.peer, seen.nbytes, len(self.completed)])
            self._remember(out, ("send", None))
        elif seen.kind == "recv":
            self.recvs.append([seen.peer, seen.nbytes])
            if seen.via == "functional":      # completes at wait_tensor: count it as done now
                self.completed.append(len(self.recvs) - 1)
            else:
                self._remember(out, ("recv", len(self.recvs) - 1))

    def _remember(self, out, what) -> None:
        work = out[-1] if isinstance(out, tuple) else out
        if isinstance(work, torch.ScriptObject):
            try:
                work = dist.distributed_c10d.Work.unbox(work)
            except RuntimeError:
                return
        self._pending[id(work)] = (what, work)   # keep it alive: its id must not be reused meanwhile

    # -------------------------------------------------------------- the Work side
    def _waited(self, work) -> None:
        entry = self._pending.pop(id(work), None)
        if entry is None:
            # A work we did not hand out (NCCL coalesces a batch into one): everything posted so far is done.
            for (kind, index), _ in list(self._pending.values()):
                if kind == "recv" and index not in self.completed:
                    self.completed.append(index)
            self._pending = {k: v for k, v in self._pending.items() if v[0][0] != "recv"}
            return
        (kind, index), _ = entry
        if kind == "recv":
            self.completed.append(index)

    def __enter__(self):
        c10d = dist.distributed_c10d
        self._saved_wait, self._saved_new_group = c10d.Work.wait, c10d.new_group
        real_wait, real_new_group, watch = c10d.Work.wait, c10d.new_group, self

        def wait(work, *args, **kwargs):
            done = real_wait(work, *args, **kwargs)
            watch._waited(work)
            return done

        def new_group(ranks=None, *args, **kwargs):
            watch.groups.append(None if ranks is None else sorted(ranks))
            return real_new_group(ranks, *args, **kwargs)

        c10d.Work.wait = wait
        dist.new_group = c10d.new_group = new_group
        return super().__enter__()

    def __exit__(self, *exc):
        c10d = dist.distributed_c10d
        c10d.Work.wait = self._saved_wait
        dist.new_group = c10d.new_group = self._saved_new_group
        return super().__exit__(*exc)

    def record(self) -> dict:
        """What the checker brings back from this rank (plain lists)."""
        return {"rank": dist.get_rank(), "sends": self.sends, "recvs": self.recvs, "completed": self.completed,
                "collectives": self.collectives,
                "groups": self.groups, "group_count": dist.distributed_c10d._world.group_count}


# ------------------------------------------------------------------ analysis in the notebook's kernel
def summary(record: dict) -> dict:
    """Per-rank figures: bytes and messages sent and received, the peers, the largest message, collective calls."""
    sends, recvs = record["sends"], record["recvs"]
    calls: dict[str, int] = {}
    for name, *_ in record["collectives"]:
        calls[name] = calls.get(name, 0) + 1
    return {"bytes_sent": sum(s[1] for s in sends), "messages_sent": len(sends),
            "bytes_recv": sum(r[1] for r in recvs), "messages_recv": len(recvs),
            "sent_to": sorted({s[0] for s in sends}), "recv_from": sorted({r[0] for r in recvs}),
            "largest_message": max((s[1] for s in sends), default=0), "collectives": calls,
            "collective_calls": [tuple(c) for c in record["collectives"]], "groups": record["groups"]}


def rounds(records: list[dict]) -> int | None:
    """Longest chain of dependent messages over all ranks (None when a receive from any source cannot be matched).

    The k-th message rank a sends to rank b is the k-th one b receives from a (c10d keeps the order per pair).
    """
    by_rank = {r["rank"]: r for r in records}
    sent_index: dict[tuple[int, int], list[int]] = {}
    for rank, rec in by_rank.items():
        for i, (peer, _, _) in enumerate(rec["sends"]):
            sent_index.setdefault((rank, peer), []).append(i)
    matched: dict[tuple[int, int], tuple[int, int]] = {}     # (rank, recv index) -> (sender, send index)
    for rank, rec in by_rank.items():
        seen: dict[int, int] = {}
        for j, (peer, _) in enumerate(rec["recvs"]):
            if peer is None or peer < 0:
                return None
            k = seen.get(peer, 0)
            seen[peer] = k + 1
            sends = sent_index.get((peer, rank), [])
            if k >= len(sends):
                return None
            matched[(rank, j)] = (peer, sends[k])
    depth: dict[tuple[int, int], int] = {}

    def stamp(rank: int, i: int) -> int:
        if (rank, i) not in depth:
            done = by_rank[rank]["completed"][: by_rank[rank]["sends"][i][2]]
            depth[(rank, i)] = 1 + max((stamp(*matched[(rank, j)]) for j in done if (rank, j) in matched),
                                       default=0)
        return depth[(rank, i)]

    return max((stamp(r, i) for r, rec in by_rank.items() for i in range(len(rec["sends"]))), default=0)
