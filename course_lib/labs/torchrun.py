"""Start torchrun from Python with a free rendezvous port, a time bound and its output kept (tests, notebooks 16-17)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .group import FRESH_STORE_ENV

REPO = str(Path(__file__).resolve().parents[2])


@dataclass
class Finished:
    """How one torchrun (one "node") ended."""

    returncode: int | None  # None: stopped by us when the time bound ran out
    output: str  # stdout and stderr together, as a terminal would show them
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def free_port() -> int:
    """A port nobody listens on now. Someone may take it before torchrun binds it: run() retries on EADDRINUSE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(module: str, args=(), nproc: int = 2, nnodes: int = 1, node_rank: int = 0, port: int = 29400,
            max_restarts: int = 0) -> list[str]:
    """The torchrun command line for one node, with c10d rendezvous on 127.0.0.1 (a one-machine stand-in for HOST)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            # Node 0 hosts the rendezvous store; saying so avoids both "nodes" of one machine trying to.
            f"--rdzv-conf=is_host={1 if node_rank == 0 else 0}", "--local-addr=127.0.0.1",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1", "-m", module, *map(str, args)]


def environment(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets 1 anyway, with a warning banner; say it ourselves
    env[FRESH_STORE_ENV] = "1"  # a fresh store per restart: no stale peer addresses (see group.py)
    env.update(extra or {})
    return env


def _start(cmd: list[str], env: dict) -> subprocess.Popen:
    # A session of its own, so a time-out ends torchrun and every worker it started, and nothing else.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=REPO, start_new_session=True)


def _finish(p: subprocess.Popen, deadline: float, t0: float) -> Finished:
    try:
        out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        return Finished(p.returncode, out, time.monotonic() - t0)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, _ = p.communicate(timeout=3)
                break
            except subprocess.TimeoutExpired:
                out = ""
        return Finished(None, (out or "") + f"\n[stopped after {deadline - t0:.0f} s]", time.monotonic() - t0)


def run_nodes(module: str, args=(), nnodes: int = 1, nproc: int = 2, timeout: float = 60.0, max_restarts: int = 0,
              env: dict | None = None) -> list[Finished]:
    """Run `nnodes` torchrun "nodes" of `nproc` workers each on this machine, all within `timeout` seconds."""
    for attempt in range(3):
        port, t0 = free_port(), time.monotonic()
        deadline = t0 + timeout
        procs = [_start(command(module, args, nproc, nnodes, i, port, max_restarts), environment(env))
                 for i in range(nnodes)]
        results: list[Finished | None] = [None] * nnodes

        def wait(i):
            results[i] = _finish(procs[i], deadline, t0)

        threads = [threading.Thread(target=wait, args=(i,)) for i in range(nnodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if attempt < 2 and any("EADDRINUSE" in r.output or "address already in use" in r.output.lower()
                               for r in results if r.returncode):
            continue  # someone took the free port first: a new port, a new try
        return results
    return results


def run(module: str, args=(), nproc: int = 2, timeout: float = 60.0, max_restarts: int = 0,
        env: dict | None = None) -> Finished:
    """One torchrun node of `nproc` workers running `python -m module args`, within `timeout` seconds."""
    return run_nodes(module, args, 1, nproc, timeout, max_restarts, env)[0]


def show(result: Finished, keep=("rank", "Error", "error", "Restarting", "restart", "failed", "Ranks")) -> None:
    """Print the lines of torchrun's output a learner should read (everything, when `keep` is empty)."""
    for line in result.output.splitlines():
        if not keep or any(k in line for k in keep):
            print(line)
