"""From the notebook to a cluster: a function run with ``run(fn, world_size=N)``, or the cells of a ``%%ranks``
group, written out as a standalone script that torchrun runs unchanged, on one node or several (notebook 17).

``export(fn, "train.py", args=(5,))`` writes the imports the function needs, the source of every helper it calls
that the notebook defined (and the constants it reads), the function itself, and a ``main()`` that joins the
process group from torchrun's environment, calls the function and saves each rank's result with ``torch.save``.
``export_ranks("cells.py")`` does the same for the ``%%ranks`` cells run since the last ``%ranks start``.
"""

from __future__ import annotations

import ast
import builtins
import dis
import importlib
import inspect
import textwrap
import types
from pathlib import Path

HEADER = '''#!/usr/bin/env python
"""{what}, exported from a notebook of the distributed-training course.

One node:    torchrun --standalone --nproc-per-node={n} {name} --out {stem}-results
Two nodes:   torchrun --nnodes=2 --node-rank=I --nproc-per-node={n} --rdzv-backend=c10d \\
                 --rdzv-endpoint=HOST:29400 {name} --out {stem}-results     (I = 0 on HOST, 1 on the other node)
Each rank saves what it returned in --out/rank<RANK>.pt (torch.load reads it back).
"""
'''

SETUP = '''

def join_process_group(timeout_s: float):
    """The process group torchrun describes in each worker's environment (env://): NCCL when this node has a GPU
    for each of its workers, worker LOCAL_RANK on its own GPU, else gloo; course_lib.device() makes the same choice."""
    if "RANK" not in os.environ:
        raise SystemExit("RANK is not set: start this script with torchrun, e.g. "
                         "torchrun --standalone --nproc-per-node=2 " + sys.argv[0])
    backend, dev = choose(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                            device_id=dev if backend == "nccl" else None)
    return dev


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default={out!r}, help="folder for each rank's result (rank<RANK>.pt)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")
    options = parser.parse_args()
    dev = join_process_group(options.timeout)
    try:
        result = {body}
        out = Path(options.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / f"rank{{dist.get_rank()}}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

BASE_IMPORTS = ["import argparse", "import os", "import sys", "from datetime import timedelta",
                "from pathlib import Path", "", "import torch", "import torch.distributed as dist",
                "from course_lib.labs.group import choose"]


class ExportError(ValueError):
    """A name the function uses that a script cannot recreate: the message says what to change."""


def _global_names(code: types.CodeType) -> list[str]:
    """Names the code (and the functions and comprehensions nested in it) reads as globals, in first-use order."""
    names = [i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return list(dict.fromkeys(names))


def _codes(obj) -> list[types.CodeType]:
    if inspect.isfunction(obj):
        return [obj.__code__]
    return [f.__code__ for f in vars(obj).values() if inspect.isfunction(f)]  # a class: its methods


def _from_notebook(obj) -> bool:
    return getattr(obj, "__module__", None) == "__main__" and (inspect.isfunction(obj) or inspect.isclass(obj))


def _import_line(name: str, value) -> str | None:
    """How a script gets `value` under `name`: an import line checked to give back this very object."""
    if inspect.ismodule(value):
        full = value.__name__
        parent, _, last = full.rpartition(".")
        if name == full:
            return f"import {full}"
        return f"from {parent} import {last}" if parent and last == name else f"import {full} as {name}"
    module, qual = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module and qual and "." not in qual:
        try:
            if getattr(importlib.import_module(module), qual) is value:
                return f"from {module} import {qual}" + ("" if qual == name else f" as {name}")
        except ImportError:
            pass
    return None


def _literal(value) -> str | None:
    try:
        text = repr(value)
        return text if ast.literal_eval(text) == value else None
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return None


def _source(obj) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj)).rstrip() + "\n"
    except (OSError, TypeError):
        raise ExportError(f"the source of {obj.__qualname__} is not available: define it in a cell of its own "
                          "(not with exec) and run that cell again") from None


def _collect(fn, namespace: dict) -> tuple[list[str], list[str], list[str]]:
    """(import lines, constant lines, helper sources) that `fn` needs, helpers before their users."""
    imports, constants, helpers, done = [], [], [], set()

    def visit(obj):
        done.add(id(obj))
        for name in [n for code in _codes(obj) for n in _global_names(code)]:
            if name not in namespace:
                if hasattr(builtins, name):
                    continue
                raise ExportError(f"{obj.__qualname__} uses {name!r}, which is not defined in the notebook")
            value = namespace[name]
            if _from_notebook(value):
                if id(value) not in done:
                    visit(value)
                continue
            line = _import_line(name, value)
            if line is not None:
                imports.append(line)
            elif (text := _literal(value)) is not None:
                constants.append(f"{name} = {text}")
            else:
                raise ExportError(f"{obj.__qualname__} uses {name!r}, a {type(value).__name__} made in the notebook: "
                                  "build it inside the function or pass it as an argument")
        helpers.append(_source(obj))

    visit(fn)
    return list(dict.fromkeys(imports)), list(dict.fromkeys(constants)), helpers


def script_for(fn, args=(), kwargs=None, world_size: int = 4) -> str:
    """The text of a torchrun script that calls fn(*args, **kwargs) on every rank and saves what it returns."""
    if not _from_notebook(fn) or not inspect.isfunction(fn):
        raise ExportError(f"{fn!r} is not a function defined in the notebook: export the function you ran with run()")
    calls = {"args": args, "kwargs": kwargs or {}}
    for what, value in calls.items():
        if _literal(value) is None:
            raise ExportError(f"the {what} {value!r} cannot be written into a script: use numbers, strings, "
                              "tuples, lists and dicts")
    imports, constants, helpers = _collect(fn, fn.__globals__)
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in (kwargs or {}).items()]
    body = f"{fn.__name__}({', '.join(shown)})"
    return _assemble(f"{fn.__name__}()", fn.__name__, world_size, imports, constants, helpers, body)


def _import_block(imports: list[str]) -> str:
    """The base imports and the function's, torch's before the course's, one line per module."""
    names: dict[str, list[str]] = {}
    plain = []
    for line in BASE_IMPORTS + [i for i in imports if i not in BASE_IMPORTS]:
        if line.startswith("from "):
            module, _, what = line[5:].partition(" import ")
            names.setdefault(module, []).extend(w for w in [what] if w not in names.get(module, []))
        elif line:
            plain.append(line)
    froms = [f"from {m} import {', '.join(w)}" for m, w in names.items()]
    std = [ln for ln in plain + froms if ln.split()[1].split(".")[0] not in ("torch", "course_lib")]
    torch_ = sorted((ln for ln in plain + froms if ln.split()[1].split(".")[0] == "torch"),
                    key=lambda ln: (ln.startswith("from"), ln))
    course = sorted(ln for ln in froms if ln.split()[1].startswith("course_lib"))
    return "\n\n".join("\n".join(group) for group in (std, torch_, course) if group)


def _assemble(what, stem, n, imports, constants, helpers, body) -> str:
    parts = [HEADER.format(what=what, n=n, name=f"{stem}.py", stem=stem).rstrip("\n"), _import_block(imports)]
    if constants:
        parts.append("\n".join(constants))
    text = "\n\n".join(parts) + "\n" + "".join("\n\n" + h for h in helpers)
    return text + SETUP.format(out=f"{stem}-results", body=body)


def export(fn, path, args=(), kwargs=None, world_size: int = 4) -> None:
    """Write the torchrun script of fn (see script_for) to `path` and print how to run it."""
    path = Path(path)
    path.write_text(script_for(fn, args, kwargs, world_size), encoding="utf-8")
    print(f"wrote {path}: run it with  torchrun --standalone --nproc-per-node={world_size} {path}")


def _ranks_of(line: str):
    words = [w for w in line.replace(",", " ").split() if not w.startswith("--")]
    return None if not words or words == ["all"] else [int(w) for w in words]


def ranks_cells(history: list[str]) -> list[tuple[str, list[int] | None]]:
    """The %%ranks cells of a kernel's input history since the last `%ranks start`/`restart`, as (source, ranks).
    Cells run with --catch show a failure on purpose and are left out."""
    cells = []
    for raw in history:
        text = raw.lstrip()
        if text.startswith(("%ranks start", "%ranks restart")):
            cells = []
        elif text.startswith("%%ranks"):
            first, _, body = text.partition("\n")
            if "--catch" not in first.split():
                cells.append((body, _ranks_of(first[len("%%ranks"):])))
    return cells


def _showing_last_value(source: str) -> str:
    """A cell's last expression printed with its rank, as %%ranks shows it (a value of None shows nothing)."""
    tree = ast.parse(source)
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return source
    last = tree.body[-1]
    lines = source.splitlines()
    expr = "\n".join(lines[last.lineno - 1: last.end_lineno])
    # One write per line (end="" with the newline inside): the workers of a node share torchrun's stdout.
    shown = (f"_ = (\n{textwrap.indent(expr, '    ')}\n)\nif _ is not None:\n"
             f"    print(f\"[rank {{rank}}] {{_!r}}\\n\", end=\"\", flush=True)")
    return "\n".join(lines[: last.lineno - 1] + [shown] + lines[last.end_lineno:])


def ranks_script(cells: list[tuple[str, list[int] | None]], world_size: int = 4, stem: str = "cells") -> str:
    """A torchrun script running the cells in order on one namespace per rank, as the %%ranks group did: each cell
    on its ranks only, with rank, world_size, device, torch and dist defined; each rank saves that namespace's
    tensors."""
    code = ["def cells(rank, world_size, device):", '    """The %%ranks cells, in the order they ran."""']
    for i, (source, ranks) in enumerate(cells, 1):
        body = _showing_last_value(textwrap.dedent(source).strip() or "pass")
        code.append(f"    # cell {i}, on {'every rank' if ranks is None else 'ranks ' + str(ranks)}")
        if ranks is None:
            code.append(textwrap.indent(body, "    "))
        else:
            code += [f"    if rank in {tuple(ranks)!r}:", textwrap.indent(body, "        ")]
    code.append("    return {k: v for k, v in locals().items() if isinstance(v, torch.Tensor)}")
    body = "cells(dist.get_rank(), dist.get_world_size(), dev)"
    return _assemble(f"{len(cells)} %%ranks cells", stem, world_size, [], [], ["\n".join(code) + "\n"], body)


def export_ranks(path, world_size: int = 4, history: list[str] | None = None) -> None:
    """Write the %%ranks cells of this kernel (since the last %ranks start) as a torchrun script to `path`."""
    if history is None:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            raise ExportError("export_ranks reads the notebook's history: call it from a notebook cell")
        history = list(shell.history_manager.input_hist_raw)
    cells = ranks_cells(history)
    if not cells:
        raise ExportError("no %%ranks cell has run since the last %ranks start: nothing to export")
    path = Path(path)
    path.write_text(ranks_script(cells, world_size, path.stem), encoding="utf-8")
    print(f"wrote {path} ({len(cells)} cells): run it with  torchrun --standalone --nproc-per-node={world_size} {path}")
