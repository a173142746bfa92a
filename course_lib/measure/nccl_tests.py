"""Read the text that NVIDIA nccl-tests' *_perf binaries print (notebooks/07_measuring_communication.ipynb).

What the fields mean is nccl-tests' own: README.md ("Arguments") for the header, doc/PERFORMANCE.md for time, algbw
and busbw, src/common.cu for how they are measured. A table row holds one message size twice: out-of-place (the
result goes to a separate output buffer) and in-place (it overwrites the input); parse() returns one row per
(size, placement). Lines prefixed by a launcher's rank label ("0: " from srun --label) are read as the same lines.
"""

from __future__ import annotations

import re

GB = 1e9                    # nccl-tests prints GB/s with 1 GB = 1e9 bytes (algBw = bytes / 1.0E9 / sec)

_LABEL = re.compile(r"^\s*\d+:\s?")                                  # srun --label, mpirun --tag-output style
_HEADER = re.compile(r"nThread (?P<nThread>\d+) nGpus (?P<nGpus>\d+) minBytes (?P<minBytes>\d+) "
                     r"maxBytes (?P<maxBytes>\d+) step: (?P<step>\d+)\((?P<step_kind>factor|bytes)\) "
                     r"warmup iters: (?P<warmup_iters>\d+) iters: (?P<iters>\d+)")
_HEADER_MORE = re.compile(r"(agg iters|validation|graph|unalign): (-?\d+)")
_RANK = re.compile(r"#\s*Rank\s+(?P<rank>\d+)\s+(?:Group\s+(?P<group>\d+)\s+)?Pid\s+(?P<pid>\d+)\s+on\s+"
                   r"(?P<host>\S+)\s+device\s+(?P<device>\d+)\s+\[(?P<bus>[^\]]*)\]\s+(?P<name>.+?)\s*$")
_FOOTER = {"out_of_bounds": re.compile(r"#\s*Out of bounds values\s*:\s*(\d+)"),
           "avg_busbw_GBps": re.compile(r"#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")}
# The column names of the table as nccl-tests prints them since 2021 (a header line in the text overrides them).
_DEFAULT_COLUMNS = ["size", "count", "type", "redop", "root",
                    "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"]
_PER_PLACEMENT = {"time": "time_us", "algbw": "algbw_GBps", "busbw": "busbw_GBps", "#wrong": "wrong",
                  "error": "wrong"}
_LEADING = {"size": "size_bytes", "count": "count", "type": "dtype", "redop": "redop", "root": "root"}


def _number(text: str):
    """A field of the table: int, float, or None for 'N/A' (validation off, -c 0)."""
    if text == "N/A":
        return None
    try:
        return int(text)
    except ValueError:
        return float(text)


def _columns(line: str) -> list[str] | None:
    """The column names of a '#  size  count ...' header line, else None."""
    words = line.lstrip("#").split()
    return words if words[:2] == ["size", "count"] else None


def _row(fields: list[str], columns: list[str]) -> list[dict]:
    """One table line -> its out-of-place and in-place rows (extra trailing fields, e.g. -S timestamps, ignored)."""
    lead = {}
    rows, current = [], None
    for name, value in zip(columns, fields):
        if name in _LEADING:
            lead[_LEADING[name]] = _number(value) if name in ("size", "count", "root") else value
        elif name == "time":                       # each placement's group of columns starts with its time
            current = {"placement": "out-of-place" if not rows else "in-place"}
            rows.append(current)
            current["time_us"] = float(value)
        elif current is not None and name in _PER_PLACEMENT:
            current[_PER_PLACEMENT[name]] = _number(value)
    return [{**lead, **r} for r in rows]


def parse(text: str) -> dict:
    """The header, the ranks, the table rows and the footer of one nccl-tests output.

    Returns {"header": {nThread, nGpus, minBytes, maxBytes, step, step_kind, warmup_iters, iters, and when printed
    agg_iters, validation, graph, unalign}, "ranks": [{rank, group, pid, host, device, bus, name}], "rows":
    [{size_bytes, count, dtype, redop, root, placement, time_us, algbw_GBps, busbw_GBps, wrong}], "out_of_bounds":
    int or None, "avg_busbw_GBps": float or None}. Raises ValueError when the text has no table row.
    """
    out = {"header": {}, "ranks": [], "rows": [], "out_of_bounds": None, "avg_busbw_GBps": None}
    columns = _DEFAULT_COLUMNS
    for raw in text.splitlines():
        line = _LABEL.sub("", raw, count=1).rstrip()
        if not line.strip() or line.startswith("##"):      # '##': notes added above a published output
            continue
        if line.lstrip().startswith("#"):
            if m := _HEADER.search(line):
                out["header"] = {k: (v if k == "step_kind" else int(v)) for k, v in m.groupdict().items()}
                out["header"].update({k.replace(" ", "_"): int(v) for k, v in _HEADER_MORE.findall(line)})
            elif m := _RANK.match(line.lstrip()):
                r = m.groupdict()
                out["ranks"].append({**r, **{k: int(r[k]) for k in ("rank", "pid", "device")},
                                     "group": int(r["group"]) if r["group"] is not None else None})
            elif names := _columns(line):
                columns = names
            for key, pattern in _FOOTER.items():
                if m := pattern.match(line.lstrip()):
                    out[key] = _number(m.group(1))
            continue
        fields = line.split()
        if fields and fields[0].isdigit():
            out["rows"].extend(_row(fields, columns))
    if not out["rows"]:
        raise ValueError("no table row found: is this the output of an nccl-tests *_perf binary?")
    return out


def n_ranks(result: dict) -> int:
    """How many ranks ran: the 'Rank' lines of the device list (one per GPU, over every process), else
    nThread x nGpus of the header, which counts one process only (under MPI each process prints nGpus 1)."""
    if result["ranks"]:
        return len(result["ranks"])
    h = result["header"]
    return h["nThread"] * h["nGpus"]


def seconds_per_call(row: dict) -> float:
    """The time of one call recovered from a row's algbw: algbw = S / t (doc/PERFORMANCE.md), so t = S / algbw."""
    return row["size_bytes"] / (row["algbw_GBps"] * GB)
