"""Where each rank is stuck: its Python stack, dumped on request, read into one line per rank.

A rank blocked in a gloo or NCCL wait never returns to Python, so a Python signal handler would not run; the
faulthandler module writes every thread's stack from C, at the signal, the way PyTorch's own MultiProcessTestCase
reads a stuck test's processes. The rank arms it (arm) when it starts; on a timeout the kernel signals the ranks
still running (dump) and turns each main thread's stack into the learner's line and the call it waits in (where).
docs/ARCHITECTURE.md, section 3, shows a report.
"""

from __future__ import annotations

import linecache
import os
import re
import signal
import time

from .rank_failure import resolve_frames

DUMP_SIGNAL = signal.SIGUSR1
_OPEN: list = []  # the rank's dump file stays open for its whole life
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def arm(path: str) -> None:
    """In a rank: on DUMP_SIGNAL, append every thread's stack to ``path``, which first names the main thread."""
    import faulthandler
    import threading

    f = open(path, "a")  # noqa: SIM115 - faulthandler writes to it until the process ends
    f.write(f"main thread {threading.main_thread().ident:#x}\n")
    f.flush()
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True)
    _OPEN.append(f)


def dump(pids: dict[int, int], paths: dict[int, str], wait_s: float = 0.5) -> dict[int, str]:
    """Ask the ranks ``pids`` (rank -> pid) for their stacks; each rank's new text in its file, by rank."""
    start = {r: _size(paths[r]) for r in pids}
    for pid in pids.values():
        try:
            os.kill(pid, DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    end, last = time.monotonic() + wait_s, None
    while time.monotonic() < end:  # done once every file has grown and stopped growing
        sizes = {r: _size(paths[r]) for r in pids}
        if all(sizes[r] > start[r] for r in pids) and sizes == last:
            break
        last = sizes
        time.sleep(0.05)
    out = {}
    for r in pids:
        try:
            with open(paths[r]) as f:
                head = f.readline()
                f.seek(start[r])
                out[r] = head + f.read()
        except OSError:
            out[r] = ""
    return out


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def main_frames(text: str) -> list[tuple[str, int, str, str]]:
    """The main thread's frames of the last dump in ``text``, outermost first, as a traceback's (file, line, name,
    source) tuples."""
    lines = text.splitlines()
    main = lines[0].split()[-1] if lines and lines[0].startswith("main thread") else None
    stacks: dict[str, list] = {}
    current = None
    for line in lines[1:]:
        m = _THREAD.match(line)
        if m:
            current = m.group(1)
            stacks[current] = []  # a later dump of the same thread replaces the earlier one
            continue
        m = _FRAME.match(line)
        if m and current is not None:
            stacks[current].append((m.group(1), int(m.group(2)), m.group(3), ""))
    if main is None or not stacks:
        return []
    frames = next((v for k, v in stacks.items() if int(k, 16) == int(main, 16)), [])
    return frames[::-1]  # faulthandler prints the most recent call first


def where(frames, describe_file=None) -> str:
    """'dist.all_reduce at Cell In[5], line 7' or '`time.sleep(30)` at ...': the call a stack waits in and the
    learner's line that made it (outermost first frames, as in a traceback)."""
    course = os.sep + "course_lib" + os.sep
    call = next((f"dist.{name}" for filename, _, name, _ in reversed(frames)
                 if filename.endswith("distributed_c10d.py")), None)
    own = [(filename, lineno, name, line) for filename, lineno, name, line in frames
           if not _library(filename, course)]
    if not own:
        return call or ""  # no frame of the learner's: nothing to say (a rank already on its way out)
    filename, lineno, name, line = own[-1]
    source = (line or linecache.getline(filename, lineno)).strip()
    place = (describe_file or _place)(filename, lineno, name)
    if call:
        return f"{call} at {place}" + (f": `{source}`" if source else "")
    return f"`{source}` at {place}" if source else f"{name}() at {place}"


def _library(filename: str, course: str) -> bool:
    """A frame of the course, of torch, of Python's own library or an installed package: never the learner's."""
    import sysconfig

    roots = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    name = filename.replace("\\", "/")
    return (course.replace("\\", "/") in name or "/torch/" in name or filename.startswith(roots)
            or name == "<string>")  # <string>: the rank server's own entry


def _place(filename: str, lineno: int, name: str) -> str:
    """IPython's way of naming a notebook cell ('Cell In[5], line 7'), or the file's base name."""
    try:
        from IPython import get_ipython

        cell = get_ipython().compile._filename_map.get(filename)  # the cell's execution count
    except (ImportError, AttributeError):
        cell = None
    if cell is not None:
        return f"Cell In[{cell}], line {lineno}"
    return f"{os.path.basename(filename)}, line {lineno}, in {name}"


def cell_place(frames, code: str) -> str:
    """Where a persistent rank is in a %%ranks cell: the cell's own frames are '<rank r cell n>' files, whose lines
    only the rank had; the kernel has the same code."""
    for filename, lineno, _, _ in reversed(frames):
        if filename.startswith("<rank ") and filename.endswith(">"):
            source = (code.splitlines()[lineno - 1:lineno] or [""])[0].strip()
            call = next((f"dist.{n} at " for f, _, n, _ in reversed(frames) if f.endswith("distributed_c10d.py")),
                        "")
            return f"{call}cell line {lineno}" + (f": `{source}`" if source else "")
    return where(frames) or "outside the cell's code"


def flight_records(folder: str) -> dict[int, str]:
    """NCCL's flight recorder, as dumped on a watchdog timeout: each rank's last collective and its state."""
    import glob
    import pickle

    out = {}
    for path in glob.glob(os.path.join(folder, "flight_rank_*")):
        try:
            rank = int(path.rsplit("_", 1)[1])
            with open(path, "rb") as f:
                entries = pickle.load(f).get("entries", [])
        except (OSError, ValueError, pickle.UnpicklingError, AttributeError, EOFError):
            continue  # a dump cut short or of another format: the stacks still speak
        if entries:
            last = entries[-1]
            out[rank] = (f"{last.get('profiling_name', 'a collective')} number {last.get('collective_seq_id', '?')}, "
                         f"{last.get('state', 'state unknown')}")
    return out


def report(places: dict[int, str]) -> str:
    """'Where each rank was:' and one line per place, the ranks at the same place together."""
    from .rank_failure import names

    by_place: dict[str, list[int]] = {}
    for rank in sorted(places):
        by_place.setdefault(places[rank], []).append(rank)
    rows = [f"  {names(ranks)}: {place}" for place, ranks in by_place.items()]
    return "Where each rank was:\n" + "\n".join(rows)


def hang_report(failures, stacks: dict, folder: str, fn) -> str:
    """One line per place the ranks were when a launch hung: their own timed-out tracebacks, dumped stacks, and
    NCCL's flight records (run()'s report, docs/ARCHITECTURE.md section 3)."""
    places = {}
    for f in failures:  # a rank's own traceback first: its stack may have been dumped as it was leaving
        if f.phase == "teardown":  # the course's end-of-run barrier, not the learner's code
            places[f.rank] = "had returned from the function and waited for the others"
        elif f.timed_out or f.consequence:  # waited there until the timeout, or until its peer left
            places[f.rank] = where(resolve_frames(f.frames, fn))  # the headline says who timed out
    places = {r: p for r, p in places.items() if p}
    for r, frames in stacks.items():
        if r not in places and where(resolve_frames(frames, fn)):
            places[r] = where(resolve_frames(frames, fn))
    for r, last in flight_records(folder).items():  # NCCL only: what the GPU was doing
        places[r] = (places[r] + "; " if r in places else "") + f"NCCL's flight recorder: {last}"
    return report(places) if places else ""
