"""What runs inside one rank of run(): join the group, run the learner's function, report back, exit.

Forked by the rank server (forkserver.py); the kernel reads the report in rank_process.py.
docs/ARCHITECTURE.md shows the phases a rank reports: load, init, fn, teardown.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

from . import transfer
from .protocol import EXIT_OK, EXIT_RAISED, STARTED
from .rank_setup import (
    become_rank,
    failure_report,
    host_env_rendezvous,
    init_group,
    leave_env_rendezvous,
    rss_bytes,
    rules_after_own_init,
    to_cpu,
)


def _report(res_fd: int, payload: dict) -> None:
    try:
        transfer.write(res_fd, payload)
    except BrokenPipeError:
        pass  # the kernel stopped listening (it was interrupted): nobody to tell
    except Exception as exc:  # the value cannot travel: say so instead of failing silently
        transfer.write(res_fd, {
            "ok": False, "etype": "UnpicklableResult", "phase": "fn", "traceback": "", "time": time.time(),
            "message": f"the function returned a value that cannot be sent back to the notebook ({exc})"})
    finally:
        os.close(res_fd)


def main(msg: dict, fds: list[int], life_fd: int) -> int:
    """Entry point in the forked child; returns the exit code."""
    out_fd, err_fd, res_fd = fds
    become_rank(msg, out_fd, err_fd, life_fd)
    import torch.distributed as dist

    times: dict[str, float] = {}
    code, phase = EXIT_OK, "load"
    try:
        fn, args, kwargs = pickle.loads(msg["fn"])
        phase = "init"
        t0 = time.perf_counter()
        if msg["init"]:
            init_group(msg)
        else:
            host_env_rendezvous(msg)
            rules_after_own_init(msg)
        times["init_s"] = time.perf_counter() - t0
        phase = "fn"
        os.write(res_fd, STARTED)
        t1 = time.perf_counter()
        value = fn(*args, **kwargs)
        times["fn_s"] = time.perf_counter() - t1
        phase = "teardown"
        if not msg["init"]:
            leave_env_rendezvous(msg)
        if dist.is_initialized():
            t2 = time.perf_counter()
            # Same race as at setup, for groups the function made (dist.new_group): a rank that returns at once
            # must not close its sockets while a slower peer is still connecting to it.
            dist.barrier()
            dist.destroy_process_group()
            times["teardown_s"] = time.perf_counter() - t2
        report = {"ok": True, "value": to_cpu(value), "times": times, "memory": rss_bytes()}
    except BaseException as exc:
        code, report = EXIT_RAISED, failure_report(exc, phase, os.path.basename(__file__))
    sys.stdout.flush()
    sys.stderr.flush()
    _report(res_fd, report)
    return code
