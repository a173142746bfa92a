"""A rank process as the kernel sees it: its environment, how it is forked, its pipes and output, how it is ended.

One life cycle for both kinds of ranks, one-shot (launch.py) and persistent
(persistent_ranks.py); the rank's own side is rank_setup.py. docs/ARCHITECTURE.md draws it.
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
import time

from .ending import TermThenKill
from .loop import Loop
from .protocol import STARTED
from .transfer import Receiver

PIPE_BYTES = 1 << 20  # a result pipe this large moves a big result in 1 MiB reads (Linux; elsewhere the default)


def threads_per_rank(world_size: int) -> int:
    """Each rank's share of the cores, so that N ranks on one machine do not oversubscribe it."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _loopback_ifname() -> str | None:
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


def rank_env(the_plan, rank: int, check_collectives: bool) -> dict:
    """The environment of one rank: the kernel's own, plus the variables torchrun would set."""
    env = dict(os.environ)
    n = the_plan.world_size
    # Set by torchrun's agent, it makes every rank a client of an agent's store; the course has no agent, and a
    # learner's own rendezvous (MASTER_PORT=29500, tcp://...) needs rank 0 to host its store, as torch does.
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    env.update(
        MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
        GROUP_RANK="0", OMP_NUM_THREADS=str(threads_per_rank(n)), COURSE_DEVICE=the_plan.devices[rank],
    )
    if check_collectives:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    lo = _loopback_ifname()
    if lo and the_plan.backend == "gloo":
        env.setdefault("GLOO_SOCKET_IFNAME", lo)  # one machine: no need to resolve the hostname
    return env


def payload(the_plan, rank: int, *, timeout: float, check_collectives: bool, store_file: str, **extra) -> dict:
    """What the rank server hands a new rank: who it is, how to join the group, and the kernel's env and paths."""
    n = the_plan.world_size
    env = rank_env(the_plan, rank, check_collectives)
    if the_plan.backend == "nccl":
        # NCCL's flight recorder: the last collectives of each rank, dumped on a watchdog timeout into the launch's
        # folder, where the hang report reads them (runtime/stacks.flight_records); both names torch has used
        for size in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"):
            env.setdefault(size, "2000")
        for prefix in ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"):
            env.setdefault(prefix, os.path.join(os.path.dirname(store_file), "flight_rank_"))
        env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    return {"rank": rank, "local_rank": rank, "world_size": n, "backend": the_plan.backend,
            "device": the_plan.devices[rank], "store_file": store_file, "timeout": timeout,
            "threads": threads_per_rank(n), "env": env, "cwd": os.getcwd(),
            "sys_path": list(sys.path), **extra}


def rank_preloads() -> tuple[str, ...]:
    """Modules the rank server should import once for this kernel's ranks, from what the kernel has imported.

    torch imports torch._dynamo on the first use of FSDP2, DTensor, a TorchDispatchMode or any torch.optim optimizer:
    2-6 s per rank per launch on 2 cores, about 3 s once in the server. A kernel that imported FSDP2 or DTensor,
    defined its own dispatch mode, or has already paid for torch._dynamo itself (it built an optimizer, a DDP model,
    a reference run) will use them in its ranks too; any other kernel keeps the server's fast start. A dispatch mode
    whose ``_should_skip_dynamo()`` is False (the course's CommLog, AllToAllLog, ...) is not wrapped in torch's dynamo
    guard, so it imports nothing and needs no preload.
    """
    if any(name in sys.modules for name in ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor")):
        return ("torch._dynamo",)
    dispatch = sys.modules.get("torch.utils._python_dispatch")
    if dispatch is not None:
        stack = list(dispatch.TorchDispatchMode.__subclasses__())
        while stack:
            cls = stack.pop()
            if not cls.__module__.startswith("torch.") and cls._should_skip_dynamo():
                return ("torch._dynamo",)
            stack.extend(cls.__subclasses__())
    return ()


class RankProcess:
    """The kernel's view of one rank process: its pipes, what it printed, its result or reply, how it ended."""

    def __init__(self, rank: int, pid: int, fds: dict[str, int], ctl: socket.socket | None = None):
        self.rank, self.pid, self.fds, self.ctl = rank, pid, fds, ctl
        self.open = set(fds)
        self.text: dict[str, list[str]] = {"out": [], "err": []}
        self._partial = {"out": b"", "err": b""}
        self.receiver = Receiver() if "res" in fds else None
        self.started = False  # a one-shot rank began the learner's function
        self.reply = None  # a persistent rank's answer to the request being waited for
        self.exit: int | None = None
        self.exit_seen = 0.0
        self.stopped_by_us = False

    def read(self, kind: str) -> list[str]:
        """Read what pipe ``kind`` holds now; returns the new complete lines (at its end, the unfinished one too)."""
        fd = self.fds[kind]
        if kind == "res":
            self._read_result(fd)
            return []
        lines: list[str] = []
        while kind in self.open:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not data:
                self.open.discard(kind)
                data = b"\n" if self._partial[kind] else b""
            *done, self._partial[kind] = (self._partial[kind] + data).split(b"\n")
            lines += [raw.decode("utf-8", "replace") + "\n" for raw in done]
        self.text[kind] += lines
        return lines

    def _read_result(self, fd: int) -> None:
        r = self.receiver
        while r.frame is None and not r.head:  # before the frame: the started marker, once
            try:
                first = os.read(fd, 1)
            except BlockingIOError:
                return
            if not first:
                self.open.discard("res")
                return
            if first == STARTED and not self.started:
                self.started = True
            else:
                r.head = first  # a frame's length starts with a zero byte, never with the marker
        if not r.feed_from(fd):
            self.open.discard("res")

    def result(self) -> dict | None:
        """What the rank reported at its end (None if it has not, or died first)."""
        return self.receiver.value() if self.receiver else None

    def note_exit(self, exits: dict[int, int], now: float) -> None:
        if self.exit is None and self.pid in exits:
            self.exit, self.exit_seen = exits.pop(self.pid), now

    def done(self, now: float, drain_s: float) -> bool:
        """Exited, and its pipes are read to the end (or ``drain_s`` passed: a child it started may hold them)."""
        return self.exit is not None and (not self.open or now - self.exit_seen > drain_s)

    def tail(self, kind: str, lines: int = 12) -> str:
        text = "".join(self.text[kind]).rstrip("\n")
        return "\n".join(text.split("\n")[-lines:]) if text else ""

    def take_text(self, kind: str) -> str:
        """Everything printed since the last call, the unfinished last line included (persistent ranks, per cell)."""
        if self._partial[kind]:
            self.text[kind].append(self._partial[kind].decode("utf-8", "replace") + "\n")
            self._partial[kind] = b""
        text, self.text[kind] = "".join(self.text[kind]), []
        return text

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        if self.ctl is not None:
            self.ctl.close()



def library_modules(fn, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """The course_lib modules of ``fn`` and of the functions and classes passed to it. cloudpickle sends these by
    name, so every rank would import them (a checker's module, and the launcher it imports: 0.1-0.3 s per rank on 2
    cores, at every launch); the rank server imports them once instead, as it does torch."""
    values = [v for v in (fn, *args, *kwargs.values()) if inspect.isfunction(v) or inspect.isclass(v)]
    return tuple(dict.fromkeys(v.__module__ for v in values if str(v.__module__).startswith("course_lib.")))


def spawn(server, the_payload: dict, persistent: bool = False) -> RankProcess:
    """Fork one rank with pipes for its stdout and stderr, and a result pipe (or, persistent, a control socket)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    ours = theirs = None
    if persistent:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        third_r, third_w = None, theirs.fileno()
    else:
        third_r, third_w = os.pipe()
        try:
            import fcntl

            fcntl.fcntl(third_r, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (ImportError, AttributeError, OSError):
            pass  # not Linux, or above the system's limit: the default size only means more reads
    parent = [out_r, err_r] + ([third_r] if third_r is not None else [])
    try:
        pid = server.spawn(the_payload, [out_w, err_w, third_w])
    except BaseException:
        for fd in parent:
            os.close(fd)
        if ours is not None:
            ours.close()
        raise
    finally:  # the child has its own copies now (or never will): the kernel keeps only the read ends
        for fd in (out_w, err_w):
            os.close(fd)
        if theirs is not None:
            theirs.close()
        else:
            os.close(third_w)
    for fd in parent:
        os.set_blocking(fd, False)
    fds = {"out": out_r, "err": err_r} | ({} if persistent else {"res": third_r})
    return RankProcess(the_payload["rank"], pid, fds, ours)


def end_ranks(procs: list[RankProcess], server) -> None:
    """End every rank still running and return once the server reported each exit (a second Ctrl-C: SIGKILL now)."""
    ending = TermThenKill(procs)
    ending.terminate(time.monotonic())

    def tick(now: float) -> None:
        for p in procs:
            p.note_exit(server.exits, now)
        ending.tick(now)

    with server.lock:
        while True:
            loop = Loop()
            loop.watch(server.fileno(), lambda: server.pump(0))  # pids' exits; False once the server is gone
            try:
                loop.run(lambda: ending.over() or not server.alive(), tick=tick)
                return
            except KeyboardInterrupt:
                ending.kill(time.monotonic())
