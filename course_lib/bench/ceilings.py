"""This machine's copy ceilings: memcpy, loopback TCP and (on GPUs) host-to-device / device-to-device bandwidth.

Taught in notebooks/02_cluster_architecture.ipynb, where they stand next to data/links.csv. A collective can never
beat these: gloo ranks on one host move bytes over loopback TCP, and every reduction touches memory.
Run with ``python -m course_lib.bench.ceilings``. Every figure is GB/s = 1e9 bytes/s in ONE direction (bytes moved
from source to destination per second), the same convention as nccl-tests busbw and the link table.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

MiB = 1 << 20


def _repeat(fn, n_bytes: int, seconds: float, min_reps: int = 3) -> float:
    """Median GB/s of fn() moving n_bytes each call, repeated for about `seconds` (one warm-up call first)."""
    fn()
    rates, t_end = [], time.perf_counter() + seconds
    while len(rates) < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        rates.append(n_bytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def memcpy_GBps(seconds: float = 0.5, n_bytes: int = 256 * MiB) -> float:
    """dst.copy_(src) of a large CPU buffer (far bigger than the caches): bytes copied per second."""
    import torch

    src = torch.ones(n_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return _repeat(lambda: dst.copy_(src), n_bytes, seconds)


def loopback_tcp_GBps(seconds: float = 0.5, chunk: int = 4 * MiB) -> float:
    """One TCP stream over 127.0.0.1 (a sender thread, the caller receives): bytes received per second.

    Threads are enough: socket send/recv release the GIL, so both ends run at once as two processes would.
    """
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()
    payload = memoryview(bytearray(chunk))

    def send():
        with socket.create_connection(("127.0.0.1", port)) as s:
            try:
                while not stop.is_set():
                    s.sendall(payload)
            except OSError:  # the receiver closed first: that is the end of the measurement
                pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    conn, _ = server.accept()
    buf = memoryview(bytearray(chunk))
    try:
        def recv_some(n_bytes: int) -> None:
            got = 0
            while got < n_bytes:
                got += conn.recv_into(buf, min(chunk, n_bytes - got))

        recv_some(16 * MiB)  # warm-up: let TCP windows grow
        received, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            recv_some(chunk)
            received += chunk
        rate = received / (time.perf_counter() - t0) / 1e9
    finally:
        stop.set()
        conn.close()
        server.close()
        sender.join(timeout=5)
    return rate


def gpu_copies_GBps(seconds: float = 0.5, n_bytes: int = 256 * MiB) -> dict:
    """Pinned host -> cuda:0, cuda:0 -> pinned host, cuda:0 -> cuda:0, and cuda:0 -> cuda:1 when there are 2 GPUs."""
    import torch

    out = {"h2d_GBps": None, "d2h_GBps": None, "d2d_GBps": None, "p2p_GBps": None}
    # device_count() asks NVML and does not initialise CUDA: on a machine without a GPU no CUDA context is made here,
    # so a later fork of this process (the course's rank server) still works.
    if torch.cuda.device_count() == 0 or not torch.cuda.is_available():
        return out

    def timed(dst, src):
        def go():
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        return go

    host = torch.ones(n_bytes, dtype=torch.uint8).pin_memory()
    d0 = torch.empty(n_bytes, dtype=torch.uint8, device="cuda:0")
    d0b = torch.empty_like(d0)
    out["h2d_GBps"] = _repeat(timed(d0, host), n_bytes, seconds)
    out["d2h_GBps"] = _repeat(timed(host, d0), n_bytes, seconds)
    # A copy inside one GPU reads and writes its memory: n bytes copied means 2n bytes of memory traffic.
    out["d2d_GBps"] = _repeat(timed(d0b, d0), n_bytes, seconds)
    if torch.cuda.device_count() >= 2:
        d1 = torch.empty(n_bytes, dtype=torch.uint8, device="cuda:1")
        out["p2p_GBps"] = _repeat(timed(d1, d0), n_bytes, seconds)
    return out


def measure_ceilings(seconds: float = 1.0) -> dict:
    """All ceilings of this machine in GB/s one direction; GPU entries are None without CUDA.

    `seconds` is the time spent on each measurement (roughly); keys: memcpy_GBps, loopback_tcp_GBps,
    h2d_GBps, d2h_GBps, d2d_GBps, p2p_GBps.
    """
    res = {"memcpy_GBps": memcpy_GBps(seconds), "loopback_tcp_GBps": loopback_tcp_GBps(seconds)}
    res.update(gpu_copies_GBps(seconds))
    return res


def main(seconds: float = 1.0) -> dict:
    res = measure_ceilings(seconds)
    for k, v in res.items():
        print(f"{k:>18}: {'-' if v is None else f'{v:8.2f} GB/s'}")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    import sys

    main(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
