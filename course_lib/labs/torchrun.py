"""Start torchrun from Python with a free rendezvous port, a time bound and its output kept (tests, notebooks 16-17)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..runtime.devices import LAB_GPUS, gpu_count
from ..runtime.ending import end_tree
from ..runtime.loop import Loop
from .group import FRESH_STORE_ENV

REPO = str(Path(__file__).resolve().parents[2])


@dataclass
class Finished:
    """How one torchrun (one "node") ended."""

    returncode: int | None  # None: stopped by us when the time bound ran out
    output: str  # stdout and stderr together, as a terminal would show them
    seconds: float
    gpus: str | None = None  # the node's GPUs ("" = none: gloo); None = every GPU of the machine (one node)
    command: tuple[str, ...] = ()  # what was started, as command() built it

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def free_port() -> int:
    """A port nobody listens on now. Someone may take it before torchrun binds it: run() retries on EADDRINUSE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(module: str, args=(), nproc: int = 2, nnodes: int = 1, node_rank: int = 0, port: int = 29400,
            max_restarts: int = 0, host: str = "127.0.0.1") -> list[str]:
    """The torchrun command line for one node, with c10d rendezvous on host:port (notebook 17). `module` is a module
    (python -m) or, ending in .py, a script. On 127.0.0.1 the "nodes" share this machine; any other host is a real
    head node that every node must reach, and every node runs the same line."""
    here = host in ("127.0.0.1", "localhost")
    program = [module] if module.endswith(".py") else ["-m", module]
    if not here:
        # c10d ranks the nodes itself (torch's run.py: "node_rank is only used for static rdzv_backend"), the head's
        # torchrun recognises its own name in the endpoint, and each node advertises its own address.
        restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", *restarts, *program, *map(str, args)]
    # Several "nodes" of one machine all advertise loopback, and each would try to host the store: node_rank 0's
    # torchrun hosts it (is_host), the only thing node_rank decides under c10d.
    same_machine = [f"--rdzv-conf=is_host={1 if node_rank == 0 else 0}", "--local-addr=127.0.0.1"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", *same_machine,
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1", *program, *map(str, args)]


def environment(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets 1 anyway, with a warning banner; say it ourselves
    env[FRESH_STORE_ENV] = "1"  # a fresh store per restart: no stale peer addresses (see group.py)
    env.update(extra or {})
    return env


def _lifeline():
    """In the child before exec: SIGTERM when the process that started torchrun dies (a killed kernel), and
    torchrun ends its workers on SIGTERM. Linux's PR_SET_PDEATHSIG; elsewhere nothing (the deadline still holds)."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, in the parent: the child only calls it
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _start(cmd: list[str], env: dict, cwd: str = REPO) -> subprocess.Popen:
    # A session of its own, so ending it never touches the kernel's group; its workers have sessions of their own
    # (torch's SubprocessHandler), which runtime.ending.end_tree finds under it.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                         start_new_session=True, preexec_fn=_lifeline())
    os.set_blocking(p.stdout.fileno(), False)
    return p


class _Node:
    """One running torchrun: its process and the output read so far."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.chunks, self.open = proc, [], True

    def read(self) -> bool:
        """What torchrun wrote since the last read; False once its output is at its end."""
        try:
            while chunk := os.read(self.proc.stdout.fileno(), 1 << 16):
                self.chunks.append(chunk)
            self.open = False  # b"": every writer closed the pipe
        except BlockingIOError:
            pass
        return self.open

    def finished(self, stopped: float | None, t0: float) -> Finished:
        self.proc.stdout.close()
        out = b"".join(self.chunks).decode(errors="replace")
        if stopped is not None:
            return Finished(None, out + f"\n[stopped after {stopped:.0f} s]", time.monotonic() - t0)
        return Finished(self.proc.returncode, out, time.monotonic() - t0)


def _watch(procs: list[subprocess.Popen], timeout: float, t0: float) -> list[Finished]:
    """Read every node's output on the runtime's loop until all have exited, or end them at the deadline."""
    nodes = [_Node(p) for p in procs]
    loop = Loop()
    for n in nodes:
        loop.watch(n.proc.stdout, n.read)
    over = lambda: all(n.proc.poll() is not None and not n.open for n in nodes)  # noqa: E731
    try:
        in_time = loop.run(over, lambda: t0 + timeout)
    except KeyboardInterrupt:  # the stop button: torchrun and every worker end now, not at the deadline
        for p in procs:
            end_tree(p)
        raise
    if not in_time:
        for p in procs:
            end_tree(p)  # SIGTERM (torchrun stops its workers), then SIGKILL to whatever is left below it
        for n in nodes:
            n.read()
    return [n.finished(None if in_time else timeout, t0) for n in nodes]


@dataclass(frozen=True)
class NodeGPUs:
    """The GPUs each of several torchrun "nodes" on this one machine may use (their LAB_GPUS), and why."""

    per_node: tuple[str | None, ...]
    reason: str


def split_gpus(nnodes: int, nproc: int, gpus: int | None = None) -> NodeGPUs:
    """Real nodes each have their own GPUs, and worker LOCAL_RANK takes its node's GPU number LOCAL_RANK. "Nodes"
    sharing this machine see the same GPUs, so each gets its own nproc of them (node i: GPUs i·nproc..), or, when
    the machine has fewer than nnodes·nproc, none: every node then runs gloo on the CPU, because two ranks on one
    GPU fail under NCCL ("Duplicate GPU detected"). One node keeps every GPU, as torchrun alone would."""
    gpus = gpu_count() if gpus is None else gpus
    if nnodes == 1:
        return NodeGPUs((None,), f"one node: its {nproc} workers share this machine's {gpus} GPU(s) as torchrun "
                                 "gives them (NCCL when there is one per worker, else gloo)")
    need = nnodes * nproc
    shape = f"{nnodes} nodes x {nproc} worker{'s' if nproc > 1 else ''}"
    if gpus >= need:
        per = tuple(",".join(str(i * nproc + r) for r in range(nproc)) for i in range(nnodes))
        own = "; ".join(f"node {i}: GPU {g}" for i, g in enumerate(per))
        return NodeGPUs(per, f"{gpus} GPU(s) for {shape}: each node gets its own ({own}), as separate machines "
                             "have, and uses NCCL")
    if gpus == 0:
        return NodeGPUs(("",) * nnodes, "no GPU here: every node runs gloo on the CPU")
    return NodeGPUs(("",) * nnodes, f"{gpus} GPU(s) for {shape} on one machine: nodes must not share a GPU (NCCL: "
                                    "'Duplicate GPU detected'), so every node runs gloo on the CPU")


def _visible(share: str) -> str:
    """A node's share of this machine's GPUs (indexes as this process sees them) as CUDA_VISIBLE_DEVICES."""
    seen = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return share
    return ",".join(seen[int(g)] for g in share.split(",") if g)


def run_nodes(module: str, args=(), nnodes: int = 1, nproc: int = 2, timeout: float = 60.0, max_restarts: int = 0,
              env: dict | None = None) -> list[Finished]:
    """Run `nnodes` torchrun "nodes" of `nproc` workers each on this machine, all within `timeout` seconds; each
    node's GPUs as split_gpus gives them (unless `env` sets them itself). A course module reads its node's GPUs
    from LAB_GPUS; a script (`module` ending in .py, run from the current folder) knows only CUDA, so its node sees
    just its own GPUs through CUDA_VISIBLE_DEVICES, as on separate machines, and cuda:LOCAL_RANK is its own."""
    plan = split_gpus(nnodes, nproc)
    script = module.endswith(".py")
    key = "CUDA_VISIBLE_DEVICES" if script else LAB_GPUS
    envs = [environment({**({} if g is None else {key: _visible(g) if script else g}), **(env or {})})
            for g in plan.per_node]
    cwd = os.getcwd() if script else REPO
    for attempt in range(3):
        port, t0 = free_port(), time.monotonic()
        cmds = [command(module, args, nproc, nnodes, i, port, max_restarts) for i in range(nnodes)]
        results = _watch([_start(c, e, cwd) for c, e in zip(cmds, envs)], timeout, t0)
        if attempt < 2 and any("EADDRINUSE" in r.output or "address already in use" in r.output.lower()
                               for r in results if r.returncode):
            continue  # someone took the free port first: a new port, a new try
        break
    for r, e, c in zip(results, envs, cmds):
        r.gpus, r.command = e.get(key), tuple(c)
    return results


def run(module: str, args=(), nproc: int = 2, timeout: float = 60.0, max_restarts: int = 0,
        env: dict | None = None) -> Finished:
    """One torchrun node of `nproc` workers running `python -m module args`, within `timeout` seconds."""
    return run_nodes(module, args, 1, nproc, timeout, max_restarts, env)[0]


def readable(line: str) -> str:
    """A line of torchrun's output without what only this machine has: C++ source paths, the interpreter's path and
    temporary folders (the meaning stays: which worker, which exit code, which error)."""
    from ..runtime.rank_failure import clean

    line = clean(line)
    for interpreter in {os.path.realpath(sys.executable), sys.executable}:
        line = line.replace(interpreter, "python")
    return re.sub(re.escape(tempfile.gettempdir()) + r"/[^\s,'\"]*", "<temporary file>", line)


def show(result: Finished, keep=("rank", "Error", "error", "Restarting", "restart", "failed", "Ranks")) -> None:
    """Print the lines of torchrun's output a learner should read (everything, when `keep` is empty)."""
    for line in result.output.splitlines():
        if not keep or any(k in line for k in keep):
            print(readable(line))
