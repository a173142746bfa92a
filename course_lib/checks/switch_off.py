"""While a learner's function runs under a checker, the collectives and library answers an exercise forbids are off.

An exercise that asks for all-reduce built from send/recv proves nothing if ``dist.all_reduce`` still works, so
``switched_off(...)`` makes every road to a forbidden collective fail with a sentence naming the exercise: the
Python names (``dist.all_reduce``, ``dist.distributed_c10d.all_reduce``) are replaced, and a TorchDispatchMode stops
the c10d operators they all end in (so the ProcessGroup object, ``_functional_collectives`` and ``torch.ops.c10d``
are stopped too; measure/c10d_ops.py lists them). Library functions that already hold an exercise's answer (the
course's own ring, ``per_rank_bytes``) are switched off by swapping their code for a stub while the block runs.
A learner who catches the error and carries on still fails: every attempt is remembered and raised at the end.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import sysconfig
from contextlib import contextmanager

from ..measure.c10d_ops import COLLECTIVES, OP_TO_COLLECTIVE, expand, op_key


class SwitchedOff(RuntimeError):
    """The learner's code reached something its exercise switches off; the message says what and why."""


_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
_refusals: dict[str, str] = {}   # stub key -> message, for library functions switched off right now
_attempts: list[str] = []        # every refusal of the current block, even those the learner caught


def _refuse(key: str):
    """Called by a switched-off library function's stub."""
    message = _refusals.get(key, "this library function is switched off here")
    _attempts.append(message)
    raise SwitchedOff(message)


def _say(exercise: str, why: str, what: str) -> str:
    about = f"{exercise} is about {why}" if why else f"{exercise} asks you to write this yourself"
    return f"{about}; {what} is switched off here."


def _dispatch_mode_base():
    """TorchDispatchMode, kept from importing torch._dynamo (seconds per rank on 2 cores) on first use.

    Its default wraps __torch_dispatch__ in torch._disable_dynamo, which imports torch._dynamo when first called;
    a checker never compiles, so the wrapper buys nothing here. The classes are made on first use, in the rank.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

    return Mode


_classes: dict = {}


def _stop_ops(exercise: str, why: str, forbidden: set[str]):
    """A dispatch mode that refuses the operators of the forbidden collectives, however the learner reached them."""
    if "stop" not in _classes:
        class StopOps(_dispatch_mode_base()):
            def __init__(self, exercise, why, forbidden):
                super().__init__()
                self.exercise, self.why, self.forbidden = exercise, why, forbidden

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                key = op_key(func)
                name = OP_TO_COLLECTIVE.get(key)
                if name in self.forbidden:
                    shown = "send/recv" if name == "send_recv" else name
                    message = _say(self.exercise, self.why, f"{shown} (reached as torch.ops.{key})")
                    _attempts.append(message)
                    raise SwitchedOff(message)
                return func(*args, **(kwargs or {}))

        _classes["stop"] = StopOps
    return _classes["stop"](exercise, why, forbidden)


def _python_stub(message: str):
    def switched_off(*args, **kwargs):
        _attempts.append(message)
        raise SwitchedOff(message)
    return switched_off


def _resolve(path: str):
    """'course_lib.collectives.ring.ring_all_reduce', '...ColumnParallelLinear.forward' or a dict's entry."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = obj[attr] if isinstance(obj, dict) else getattr(obj, attr)   # a table of lambdas: FACTORS.all_reduce
        return obj
    raise ImportError(f"cannot find {path}")


_STUB_SOURCE = """
def _factory({cells}):
    def {name}(*args, **kwargs):
        {touch}return __import__("course_lib.checks.switch_off", fromlist=["_refuse"])._refuse({key!r})
    return {name}
"""


def _stub_code(fn, key: str):
    """A code object that refuses, with as many free variables as ``fn`` has (so it can take fn's closure)."""
    free = fn.__code__.co_freevars
    name = fn.__code__.co_name if fn.__code__.co_name.isidentifier() else "switched_off"   # a lambda: "<lambda>"
    src = _STUB_SOURCE.format(cells=", ".join(free), name=name, key=key,
                              touch=f"({', '.join(free)},)\n        " if free else "")
    scope: dict = {}
    exec(compile(src, fn.__code__.co_filename, "exec"), scope)
    return scope["_factory"](*([None] * len(free))).__code__


# Every way the course (or Python) starts ranks or processes: off while a learner's function runs under a checker,
# in the notebook's process and on the ranks, so no exercise can be answered by launching ranks of one's own.
LAUNCHERS = ("course_lib.runtime.launch.run", "course_lib.runtime.launch._launch_once",
             "course_lib.runtime.forkserver.get_server",
             "course_lib.runtime.persistent_ranks.Ranks.start",
             "course_lib.runtime.persistent_ranks.Ranks.run_cell", "course_lib.runtime.persistent_ranks.Ranks.pull",
             "course_lib.labs.torchrun.run", "course_lib.labs.torchrun.run_nodes", "course_lib.labs.torchrun._start",
             "torch.multiprocessing.spawn", "torch.multiprocessing.start_processes",
             "multiprocessing.process.BaseProcess.start", "subprocess.Popen.__init__")
_OS_LAUNCHERS = ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "execv", "execve")


def library_stubs(paths, exercise: str, why: str = "", launchers: bool = False):
    """[(function, its real code, the refusing code)] for library functions given by dotted path."""
    out = []
    for path in paths:
        fn = _resolve(path)
        fn = getattr(fn, "__func__", fn)
        key = f"{exercise}:{path}"
        short = path.removeprefix("course_lib.").removeprefix("runtime.")  # launch.run, costs.alpha_beta.x
        if path.startswith("torch.distributed."):      # torch's own call, switched off for this exercise
            _refusals[key] = _say(exercise, why, f"dist.{path.rsplit('.', 1)[1]}")
            out.append((fn, fn.__code__, _stub_code(fn, key)))
            continue
        _refusals[key] = (_say(exercise, why, f"starting ranks or processes ({path.removesuffix('.__init__')})")
                          if launchers else _say(exercise, why, f"the course's own {short} (it holds the answer)"))
        out.append((fn, fn.__code__, _stub_code(fn, key)))
    return out


def _learners_call(depth: int = 2) -> bool:
    """Whether the call being made comes from the learner's code: the first frame outside Python's standard library
    (a thread pool or a Timer reaches Thread.start through it) is neither the course's nor an installed package's
    (torch, ipykernel and their threads run as before)."""
    stdlib, installed = _places()
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(stdlib):
        frame = frame.f_back
    return frame is not None and not frame.f_code.co_filename.startswith(installed)


@functools.cache
def _places() -> tuple[str, tuple[str, ...]]:
    """Python's standard library, and where installed packages and the course live (computed once: 80 us a call)."""
    paths = sysconfig.get_paths()
    return paths["stdlib"], (paths["purelib"], paths["platlib"], os.path.dirname(os.path.dirname(__file__)))


def _off_thread_roads(exercise: str, why: str) -> list:
    """Threads and future callbacks the learner's code starts, off: a dispatch mode sees only its own thread, so a
    collective run on another one (a Thread, a thread pool, a Work's future.then on gloo's thread) would escape both
    the switch-off and the checker's record. Threads and callbacks that torch, the course or another installed
    package starts run as before."""
    import _thread
    import threading

    import torch.futures

    def guard(real, what):
        def guarded(*args, **kwargs):
            if _learners_call():
                message = _say(exercise, why, f"{what} (a collective on another thread escapes the check)")
                _attempts.append(message)
                raise SwitchedOff(message)
            return real(*args, **kwargs)
        return guarded

    roads = [(threading.Thread, "start", "starting threads (threading.Thread.start)"),
             (_thread, "start_new_thread", "starting threads (_thread.start_new_thread)"),
             *((cls, attr, f"callbacks on a collective's future (Future.{attr})")     # Work.get_future(): torch._C's
               for cls in (torch._C.Future, torch.futures.Future) for attr in ("then", "add_done_callback"))]
    saved = [(owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr))
             for owner, attr, _ in roads]
    for (owner, attr, what), (_, _, real) in zip(roads, saved):
        setattr(owner, attr, guard(real, what))
    return saved


@contextmanager
def switched_off(exercise: str, forbid=(), why: str = "", library=(), launching: bool = True):
    """Within the block, the collectives named in ``forbid`` ('all', 'all_reduce', 'send_recv', ...; see
    c10d_ops.COLLECTIVES) and the library functions in ``library`` (dotted paths) raise SwitchedOff with
    "<exercise> is about <why>; <what> is switched off here." Raised at the end too if the learner caught it.
    ``launching``: every way of starting ranks or processes (LAUNCHERS, os.fork, os.system, ...) is off too."""
    forbidden = set(expand(forbid))
    saved = []
    modules = [sys.modules.get(m) or importlib.import_module(m) for m in _MODULES]
    for name in forbidden:
        for attr in COLLECTIVES[name][0]:
            # one stub per name, set in both modules: torch compares dist.isend with its own isend (P2POp)
            stub = _python_stub(_say(exercise, why, f"dist.{attr}"))
            for module in modules:
                if hasattr(module, attr):
                    saved.append((module, attr, getattr(module, attr)))
                    setattr(module, attr, stub)
    stubs = library_stubs(library, exercise, why)
    if launching:
        stubs += library_stubs([p for p in LAUNCHERS if p not in library], exercise, why, launchers=True)
    for fn, _, stub in stubs:
        fn.__code__ = stub
    for attr in _OS_LAUNCHERS if launching else ():
        if hasattr(os, attr):
            saved.append((os, attr, getattr(os, attr)))
            setattr(os, attr, _python_stub(_say(exercise, why, f"starting processes (os.{attr})")))
    saved += _off_thread_roads(exercise, why)
    before = len(_attempts)
    mode = _stop_ops(exercise, why, forbidden) if forbidden else None
    try:
        if mode is not None:
            with mode:
                yield
        else:
            yield
        if len(_attempts) > before:   # refused, caught by the learner's code, and the function went on
            raise SwitchedOff(_attempts[before] + " (your code caught the error and went on)")
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)
        for fn, code, _ in stubs:
            fn.__code__ = code
        del _attempts[before:]
