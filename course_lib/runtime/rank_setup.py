"""Inside a freshly forked rank, before the learner's code: its own output, its lifeline, its process group.

Shared by the one-shot rank (rank_main.py) and the persistent rank (persistent_rank_main.py);
the kernel's side is rank_process.py.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

from .protocol import EXIT_ORPHANED

_OWN_STORE = []  # keeps the store that a learner's own env:// rendezvous joins alive as long as the rank


def _watch_lifeline(fd: int) -> None:
    # EOF means the rank server (and so the kernel) is gone: leave rather than linger as an orphan.
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os._exit(EXIT_ORPHANED)


def _redirect(out_fd: int, err_fd: int) -> None:
    # fd-level, so C++ output (gloo, NCCL, aborts) reaches the kernel too, not the server's log.
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)


def become_rank(msg: dict, out_fd: int, err_fd: int, life_fd: int) -> None:
    """Turn the forked child into a rank: own process group, output to the kernel, the kernel's env and paths."""
    os.setpgrp()  # our own process group, so the kernel can end this rank and anything it started
    _redirect(out_fd, err_fd)
    threading.Thread(target=_watch_lifeline, args=(life_fd,), daemon=True).start()
    os.environ.clear()
    os.environ.update(msg["env"])
    sys.path[:] = msg["sys_path"]
    try:
        os.chdir(msg["cwd"])
    except OSError:
        pass
    import torch
    import torch.distributed as dist

    if msg.get("stack_file"):  # a hang report can ask this rank where it waits (runtime/stacks.py)
        from .stacks import arm

        arm(msg["stack_file"])
    torch.set_num_threads(msg["threads"])
    dist.set_debug_level_from_env()  # torch read TORCH_DISTRIBUTED_DEBUG when the server imported it


def init_group(msg: dict) -> None:
    """Join the default process group through the launch's FileStore (NCCL on cuda:local_rank, else gloo)."""
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=msg["timeout"])
    store = dist.FileStore(msg["store_file"], msg["world_size"])
    extra = {}
    if msg["backend"] == "nccl":
        gpu = torch.device(msg["device"])  # the plan's GPU for this rank (LAB_GPUS may name others than 0..n-1)
        torch.cuda.set_device(gpu)
        extra["device_id"] = gpu
    dist.init_process_group(
        msg["backend"], store=store, rank=msg["rank"], world_size=msg["world_size"], timeout=timeout, **extra
    )
    # init_process_group returns when *this* rank's connections are up; without a barrier a fast rank can finish
    # the function and close its sockets while a slow peer is still connecting to it, and that peer fails with
    # "connectFullMesh failed ... Connection closed by peer" (seen under load).
    dist.barrier()
    if msg.get("nccl_rules"):
        from .nccl_rules import install

        install(msg["rank"], msg["timeout"])


def rules_after_own_init(msg: dict) -> None:
    """With init=False, the NCCL-rules mode comes into force when the learner's init_process_group returns,
    unless it named gloo: init_process_group() picks NCCL for GPU tensors on a GPU machine, "gloo" never does."""
    if not msg.get("nccl_rules"):
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from .nccl_rules import install

    own = c10d.init_process_group

    def init_process_group(*args, **kwargs):
        own(*args, **kwargs)
        backend = kwargs.get("backend", args[0] if args else None)
        if not (isinstance(backend, str) and backend.lower() == "gloo"):  # an explicit gloo is gloo on purpose
            install(dist.get_rank(), msg["timeout"])

    c10d.init_process_group = dist.init_process_group = init_process_group


def host_env_rendezvous(msg: dict) -> None:
    """Let the learner call ``dist.init_process_group(backend)`` themselves (env://), as under torchrun.

    Rank 0 starts a TCPStore on a port the OS picks and publishes the port through the launch's FileStore; every
    rank puts it in MASTER_PORT. The store is multi-tenant, so rank 0's own env:// rendezvous reuses it instead of
    binding the port again. A learner who sets MASTER_PORT (the PyTorch tutorial's 29500) or passes tcp://host:port
    gets exactly torch's behaviour: rank 0 hosts a store there.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=msg["timeout"])
    board = dist.FileStore(msg["store_file"], msg["world_size"])
    if msg["rank"] == 0:
        store = dist.TCPStore("127.0.0.1", 0, msg["world_size"], True, timeout, wait_for_workers=False,
                              multi_tenant=True)
        _OWN_STORE.append(store)
        board.set("course_lib/master_port", str(store.port))
    board.set_timeout(timeout)
    os.environ["MASTER_PORT"] = board.get("course_lib/master_port").decode()
    _OWN_STORE.append(board)


def leave_env_rendezvous(msg: dict) -> None:
    """Rank 0 keeps hosting the store until every rank's function has returned: a peer may still be reading it."""
    board = _OWN_STORE[-1]
    board.set(f"course_lib/returned/{msg['rank']}", "1")
    if msg["rank"] == 0:
        board.wait([f"course_lib/returned/{r}" for r in range(msg["world_size"])])


def to_cpu(value):
    """A returned value with its tensors detached and on the CPU (what can travel to the notebook)."""
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu() if value.device.type != "cpu" else value.detach()
        # the NCCL-rules mode marks host tensors with a subclass that only the rank knows
        return value if type(value) is torch.Tensor else value.as_subclass(torch.Tensor)
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def failure_report(exc: BaseException, phase: str, this_file: str) -> dict:
    """An exception as data; frames travel raw so the kernel can fill in notebook-cell lines only it knows."""
    frames = [(f.filename, f.lineno, f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)
              if os.path.basename(f.filename) != this_file]
    return {"ok": False, "etype": type(exc).__name__, "message": str(exc), "phase": phase, "frames": frames,
            "traceback": "".join(traceback.format_exception(exc)), "time": time.time()}


def rss_bytes() -> dict:
    """This rank's resident and private memory (Linux /proc), for the launch benchmark."""
    out = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kib = lambda k: int(fields[k].split()[0]) * 1024  # noqa: E731
        out["rss"] = kib("Rss")
        out["private"] = kib("Private_Clean") + kib("Private_Dirty")
    except (OSError, KeyError, ValueError):
        pass
    return out
