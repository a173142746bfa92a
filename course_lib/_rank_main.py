"""What runs inside one rank process, forked by the rank server: set up, run the learner's function, report back."""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import threading
import time
import traceback
from datetime import timedelta

_LEN = struct.Struct("!Q")


def _watch_lifeline(fd: int) -> None:
    # EOF means the rank server (and so the kernel) is gone: leave rather than linger as an orphan.
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os._exit(75)


def _redirect(out_fd: int, err_fd: int) -> None:
    # fd-level, so C++ output (gloo, NCCL, aborts) reaches the kernel too, not the server's log.
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)


def _to_cpu(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value.detach()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _report(res_fd: int, payload: dict) -> None:
    import cloudpickle

    try:
        data = cloudpickle.dumps(payload)
    except Exception as exc:  # the value cannot travel: say so instead of failing silently
        data = cloudpickle.dumps(
            {
                "ok": False,
                "etype": "UnpicklableResult",
                "message": f"the function returned a value that cannot be sent back to the notebook ({exc})",
                "traceback": "",
                "time": time.time(),
            }
        )
    with os.fdopen(res_fd, "wb") as f:
        f.write(_LEN.pack(len(data)) + data)


def _rss_bytes() -> dict:
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


def init_group(msg: dict) -> None:
    """Join the default process group through the launch's FileStore (NCCL on cuda:local_rank, else gloo)."""
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=msg["timeout"])
    store = dist.FileStore(msg["store_file"], msg["world_size"])
    extra = {}
    if msg["backend"] == "nccl":
        torch.cuda.set_device(msg["local_rank"])
        extra["device_id"] = torch.device("cuda", msg["local_rank"])
    dist.init_process_group(
        msg["backend"], store=store, rank=msg["rank"], world_size=msg["world_size"], timeout=timeout, **extra
    )
    # init_process_group returns when *this* rank's connections are up; without a barrier a fast rank can finish
    # the function and close its sockets while a slow peer is still connecting to it, and that peer fails with
    # "connectFullMesh failed ... Connection closed by peer" (seen here under load).
    dist.barrier()


def become_rank(msg: dict, out_fd: int, err_fd: int, life_fd: int) -> None:
    """Turn the freshly forked child into a rank: own process group, output to the kernel, the kernel's env."""
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


def main(msg: dict, fds: list[int], life_fd: int) -> int:
    """Entry point in the forked child; returns the exit code."""
    out_fd, err_fd, res_fd = fds
    become_rank(msg, out_fd, err_fd, life_fd)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(msg["threads"])
    # torch reads TORCH_DISTRIBUTED_DEBUG when torch.distributed is imported, which happened in the server.
    dist.set_debug_level_from_env()

    times: dict[str, float] = {}
    code = 0
    phase = "load"
    try:
        fn, args, kwargs = pickle.loads(msg["fn"])
        phase = "init"
        if msg["init"]:
            t0 = time.perf_counter()
            init_group(msg)
            times["init_s"] = time.perf_counter() - t0
        phase = "fn"
        os.write(res_fd, b"S")  # tells the kernel the learner's code has started: from here on, never retry
        t1 = time.perf_counter()
        value = fn(*args, **kwargs)
        times["fn_s"] = time.perf_counter() - t1
        phase = "teardown"
        if dist.is_initialized():
            t2 = time.perf_counter()
            # Same race as at setup, for groups the function made (dist.new_group): a rank that returns at once
            # must not close its sockets while a slower peer is still connecting to it.
            dist.barrier()
            dist.destroy_process_group()
            times["teardown_s"] = time.perf_counter() - t2
        payload = {"ok": True, "value": _to_cpu(value), "times": times, "memory": _rss_bytes()}
    except BaseException as exc:
        code = 1
        payload = {
            "ok": False,
            "etype": type(exc).__name__,
            "message": str(exc),
            "phase": phase,
            "traceback": "".join(traceback.format_exception(exc)),
            # Frames travel as data: the kernel fills in notebook-cell source lines, which only it knows.
            "frames": [
                (f.filename, f.lineno, f.name, f.line)
                for f in traceback.extract_tb(exc.__traceback__)
                if os.path.basename(f.filename) != "_rank_main.py"
            ],
            "time": time.time(),
        }
    sys.stdout.flush()
    sys.stderr.flush()
    _report(res_fd, payload)
    return code
