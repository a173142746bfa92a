"""NCCL-rules mode, part 2: a rank's communication runs in issue order, and a cycle of waiting ranks is a deadlock.

On NCCL, the sends, receives and collectives a rank issues on one process group go to one communicator and run in
the order they were issued (one CUDA stream; sends and receives to different peers overlap only when grouped with
``batch_isend_irecv``, which is ncclGroupStart/End). gloo posts them independently, so a ring of ranks that each
post ``irecv`` from the left before ``isend`` to the right works on a laptop and hangs on GPUs. Under the mode each
call waits until the rank's previous call on that group has completed, as NCCL's stream would; a rank that waits
publishes what it waits for in the launch's store, and when the waiting ranks form a cycle (each needs a call that
the next one cannot make) every rank of the cycle raises, naming the others. docs/ARCHITECTURE.md lists the rules.
"""

from __future__ import annotations

import json
import sys
import threading
import time

SPIN_S = 0.02          # waits shorter than this are never published: the common case costs no store access
CHECK_EVERY_S = 0.1    # how often a waiting rank reads the others' records
CONFIRM_READS = 3      # a cycle counts once it reads the same in this many checks in a row


class Waited:
    """A gloo send/recv Work seen through one thread that waits on it.

    gloo's send and receive works say they are completed only once wait() returned, and a second wait() on a
    receive waits for another message; so one thread waits, and the rank (and the learner) poll and wait on this.
    """

    def __init__(self, work):
        self._work, self._done, self._exc = work, threading.Event(), None
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        try:
            self._work.wait()
        except BaseException as exc:  # noqa: BLE001  handed to whoever waits
            self._exc = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._exc is None

    def exception(self):
        return self._exc

    def wait(self, timeout=None) -> bool:
        self._done.wait()  # gloo's own timeout ends the wait on the thread
        if self._exc is not None:
            raise self._exc
        return True

    def __getattr__(self, name):
        return getattr(self._work, name)


class Unit:
    """One posted piece of communication a rank waits for: a p2p call, a batch of them, or a collective."""

    def __init__(self, works, needs, call: str, where: str, lazy: bool = False):
        self.works, self.needs, self.call, self.where = [w for w in works if w is not None], needs, call, where
        self.on_done = None  # a check that can only run once the call completed (the tag of a received message)
        self.lazy = lazy     # a gloo work that reports completion only once waited for (its reduce-scatters)

    def done(self) -> bool:
        if self.lazy:  # polling would never see it finish: wait for it, as NCCL's stream would before the next call
            for w in self.works:
                w.wait()
            return True
        return all(w.is_completed() for w in self.works)


class Order:
    """The issue-order state of one rank: what it has posted per channel, and the unit it has not seen finish."""

    def __init__(self, rank: int, store, deadline_s: float, error):
        self.rank, self.store, self.deadline_s, self.error = rank, store, deadline_s, error
        self.posted: dict[str, int] = {}  # "s3" sends to rank 3, "r3" receives from 3, "c<group>" collectives
        self.pending: dict[str, Unit] = {}  # group name -> the last unit posted on it
        self.epoch = 0

    def count(self, key: str) -> int:
        self.posted[key] = self.posted.get(key, 0) + 1
        return self.posted[key]

    def before_post(self, group: str) -> None:
        """Wait, as NCCL's stream would, until the previous call on this group has completed."""
        if threading.current_thread() is not threading.main_thread():
            # a future's callback (a DDP communication hook's continuation) may run while the unit it follows
            # is not yet marked complete: waiting there would wait for itself
            return
        unit = self.pending.pop(group, None)
        if unit is not None:
            self.wait(unit)

    def after_post(self, group: str, unit: Unit, blocking: bool) -> None:
        if blocking:
            self.wait(unit)
        elif threading.current_thread() is threading.main_thread():
            self.pending[group] = unit

    def wait(self, unit: Unit) -> None:
        """Poll the unit; past SPIN_S publish what it needs, and raise when the waiting ranks form a cycle."""
        start, published, sleep = time.monotonic(), False, 5e-5
        last_check, seen, streak = 0.0, None, 0
        try:
            while not unit.done():
                now = time.monotonic()
                if now - start > SPIN_S and not published:
                    self.epoch += 1
                    self._publish({"epoch": self.epoch, "posted": self.posted, "needs": unit.needs,
                                   "call": unit.call, "where": unit.where})
                    published = True
                if published and now - last_check > CHECK_EVERY_S:
                    last_check = now
                    cycle, records = self._cycle()
                    key = json.dumps([(r, records[r]["epoch"]) for r in cycle]) if cycle else None
                    streak = streak + 1 if key is not None and key == seen else (1 if key else 0)
                    seen = key
                    if streak >= CONFIRM_READS:
                        published = False  # keep the record: the other ranks of the cycle read it and stop too
                        raise self.error("p2p-order", _describe(cycle, records))
                if now - start > self.deadline_s:
                    raise self.error("p2p-order", f"rank {self.rank} waited {self.deadline_s:.0f} s in {unit.call} "
                                     f"({unit.where}) and no cycle of waiting ranks formed: a peer never made the "
                                     "matching call")
                time.sleep(sleep)
                sleep = min(sleep * 2, 0.005)
        finally:
            if published:
                self._publish(None)
        for w in unit.works:
            w.wait()  # a failed call (a peer's timeout, a closed connection) raises here as it would without the mode
        if unit.on_done is not None:
            unit.on_done()

    def _publish(self, record) -> None:
        self.store.set(f"course_nccl_rules/wait/{self.rank}", json.dumps(record))

    def _records(self) -> dict[int, dict]:
        out = {}
        for r in range(_world()):
            key = f"course_nccl_rules/wait/{r}"
            if self.store.check([key]):
                rec = json.loads(self.store.get(key))
                if rec is not None:
                    out[r] = rec
        return out

    def _cycle(self):
        """A cycle through this rank among the waiting ranks, each waiting for a call the next has not posted."""
        records = self._records()

        def blockers(r):
            rec = records[r]
            return [peer for peer, key, need in rec["needs"]
                    if peer in records and records[peer]["posted"].get(key, 0) < need]

        path, on_path = [self.rank], {self.rank}

        def walk(r):
            for q in blockers(r):
                if q == self.rank:
                    return True
                if q not in on_path:
                    path.append(q)
                    on_path.add(q)
                    if walk(q):
                        return True
                    on_path.discard(path.pop())
            return False

        if self.rank in records and walk(self.rank):
            return path, records
        return None, records


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _describe(cycle, records) -> str:
    steps = []
    for i, r in enumerate(cycle):
        nxt = cycle[(i + 1) % len(cycle)]
        steps.append(f"rank {r} waits in {records[r]['call']} ({records[r]['where']}) for rank {nxt}")
    return ("this would deadlock on NCCL, where a rank's sends, receives and collectives on one group run in the "
            "order it issued them: " + "; ".join(steps) + ", which is itself waiting")


_TORCH_DIR: list = []


def in_torch(filename: str) -> bool:
    """The file is part of the torch package (its own calls are never the learner's)."""
    if not _TORCH_DIR:
        import os

        import torch

        _TORCH_DIR.append(os.path.dirname(torch.__file__) + os.sep)
    return filename.startswith(_TORCH_DIR[0])


def learner_line() -> str:
    """Where the learner's code made the call: the nearest frame outside torch, this mode and hidden wrappers."""
    import os

    course = os.path.dirname(os.path.abspath(__file__)) + os.sep
    fallback, frame = None, sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        # a wrapper that marks itself hidden (pytest's and IPython's __tracebackhide__) is never the learner's line
        hidden = "__tracebackhide__" in frame.f_code.co_varnames
        if not (in_torch(name) or hidden or name.endswith(("nccl_order.py", "nccl_rules.py", "nccl_host.py"))):
            where = f"{frame.f_code.co_name}, line {frame.f_lineno}"
            if not name.startswith(course):
                return where
            fallback = fallback or where  # the course's own code, when no learner's frame is above it
        frame = frame.f_back
    return fallback or "unknown line"
