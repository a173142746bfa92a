"""What this machine lets a launch do, checked before any process starts: an OS that can fork ranks, and enough
memory and file descriptors for ``world_size`` of them."""

from __future__ import annotations

import os
import sys

from .results import LaunchError

# A rank that trains a small model (DDP, Adam, a few steps) holds about 125 MiB of private memory; the rest of
# its pages are shared with the rank server. ``python -m course_lib bench launch`` measures it on this machine.
RANK_MEMORY_BYTES = 128 * 2**20
# File descriptors: the kernel keeps 3 pipes per rank; a gloo rank holds one socket per peer plus about 10 more.
KERNEL_FDS_PER_RANK, KERNEL_FDS_BASE = 3, 64
RANK_FDS_BASE = 16

WINDOWS = (
    "Native Windows cannot run the ranks: the launcher starts them by fork() from a server process, and Windows "
    "has no fork() (Python's os.fork is POSIX only). Run the course on Linux or macOS, or on Windows inside WSL2 "
    "(wsl --install, then follow the README in the Ubuntu shell)."
)


def check_platform(platform: str | None = None) -> None:
    """Refuse native Windows with a sentence pointing to WSL2."""
    if (platform or sys.platform).startswith(("win32", "cygwin")):
        raise LaunchError(WINDOWS)


def available_memory() -> int | None:
    """Bytes of memory a new process can still get (Linux: MemAvailable; elsewhere all physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def open_files_limit() -> int | None:
    """How many file descriptors a process here may open (``ulimit -n``)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def max_ranks(memory: int | None = None, files: int | None = None) -> int | None:
    """The largest world size this machine holds by memory and file descriptors (None: nothing to go by)."""
    memory = available_memory() if memory is None else memory
    files = open_files_limit() if files is None else files
    bounds = []
    if memory:
        bounds.append(memory // RANK_MEMORY_BYTES)
    if files:
        bounds += [(files - KERNEL_FDS_BASE) // KERNEL_FDS_PER_RANK, files - RANK_FDS_BASE]
    return max(1, min(bounds)) if bounds else None


def check_world_size(world_size: int, oversubscribe: bool = False, memory: int | None = None,
                     files: int | None = None) -> None:
    """Refuse a world size beyond what this machine holds, saying the figures; ``oversubscribe=True`` skips it."""
    if oversubscribe:
        return
    memory = available_memory() if memory is None else memory
    files = open_files_limit() if files is None else files
    most = max_ranks(memory, files)
    if most is None or world_size <= most:
        return
    why = []
    need = world_size * RANK_MEMORY_BYTES
    if memory and need > memory:
        why.append(f"{world_size} ranks need about {need / 2**30:.1f} GiB of memory (about "
                   f"{RANK_MEMORY_BYTES / 2**20:.0f} MiB each, what a rank training a small model holds) and "
                   f"{memory / 2**30:.1f} GiB is available")
    kernel_fds = KERNEL_FDS_BASE + KERNEL_FDS_PER_RANK * world_size
    if files and max(kernel_fds, RANK_FDS_BASE + world_size) > files:
        why.append(f"they need about {kernel_fds} open files in this kernel and {RANK_FDS_BASE + world_size} in "
                   f"each rank (one socket per peer), and a process here may open {files} (ulimit -n)")
    raise LaunchError(f"world_size={world_size} is more than this machine can hold: {'; '.join(why)}. Use at most "
                      f"{most} ranks, or pass oversubscribe=True to start them anyway.")
