"""The rank server: a process with torch imported that forks every rank, so a launch costs a fork, not an import.

Why our own instead of ``multiprocessing``'s forkserver: its children re-import the parent's ``__main__``
(``ipykernel_launcher`` in a notebook, i.e. all of IPython) on every launch, it gives no hook to set up each
child's file descriptors before user code runs, and its internals changed in Python 3.14. This one is small:
the kernel sends "fork a rank with these fds and this payload" over a Unix socket; the server forks, reports the
child's pid, and later the child's exit status. It is started with exec (a fresh interpreter), so CUDA or threads
of the kernel never reach a rank. What it imports besides torch is the caller's choice (``get_server(preload)``).
The messages are listed in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from .ending import end_tree
from .loop import Loop, readable
from .protocol import EXIT_CHILD_BROKEN, SERVER_START_S, recv_msg, send_msg

# ---------------------------------------------------------------- server side (its own process)


def serve(sock_fd: int, preload: tuple = ()) -> None:
    """Main loop of the server process: import torch (and ``preload``), then fork one child per request."""
    sock = socket.socket(fileno=sock_fd)
    try:
        import cloudpickle  # noqa: F401  (preloaded so children do not pay for it)
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401

        for name in preload:  # the callers' choice: the entry modules of their ranks, torch._dynamo for some
            importlib.import_module(name)
        # Python's advice for a process that forks without exec (the gc.freeze documentation): the children's
        # collections then skip the objects they inherit (torch's), and their pages stay shared.
        gc.freeze()
    except BaseException as exc:  # tell the kernel why we cannot serve, then leave
        _tell(sock, ("failed", f"{type(exc).__name__}: {exc}"))
        return
    # The lifeline: every child holds the read end; when this server dies (because the kernel died and closed
    # our socket), the children read EOF and exit, so no rank outlives its notebook.
    life_r, life_w = os.pipe()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the kernel is not for us
    if not _tell(sock, ("ready", os.getpid())):
        return  # the kernel left while we imported torch (a notebook closed right after importing run)
    loop = Loop()

    def woken() -> bool:  # SIGCHLD: a child exited
        try:
            while os.read(wake_r, 512):
                pass
        except BlockingIOError:
            pass
        _reap(sock)
        return True

    def request() -> bool:  # the kernel asks: import more, or fork a rank; EOF when the kernel is gone
        try:
            msg, fds = recv_msg(sock)
        except (ConnectionResetError, BrokenPipeError):  # a kernel that exited without closing: gone all the same
            return False
        if msg is None:
            return False
        if isinstance(msg, tuple) and msg[0] == "import":  # more modules for the children, from now on
            for name in msg[1]:
                try:
                    importlib.import_module(name)
                except Exception:  # an optimisation only: a rank that needs it reports its own error
                    pass
            gc.freeze()
            return True
        pid = os.fork()
        if pid == 0:
            code = EXIT_CHILD_BROKEN
            try:
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGCHLD, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                loop.close()
                for fd in (wake_r, wake_w, life_w):
                    os.close(fd)
                sock.close()
                # The request names the rank's entry module (one-shot or persistent ranks).
                code = importlib.import_module(msg["entry"]).main(msg, fds, life_r)
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        _tell(sock, ("pid", msg.get("request"), pid))
        _reap(sock)
        return True

    loop.watch(wake_r, woken)
    loop.watch(sock, request)
    loop.run(lambda: sock.fileno() == -1 or not loop.watching(sock))


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _tell(sock, ("exit", pid, os.waitstatus_to_exitcode(status)))


def _tell(sock: socket.socket, msg) -> bool:
    """Send to the kernel; False when it has gone (the loop then reads EOF and the server leaves)."""
    try:
        send_msg(sock, msg)
        return True
    except (BrokenPipeError, ConnectionResetError):
        return False


# ---------------------------------------------------------------- kernel side

# A process that imported torch spends about half a second of its exit in the garbage collector, walking torch's
# objects (0.57 s against 0.12 s with this, measured on 2 cores): a kernel that starts ranks restarts and shuts
# down that much faster. Only objects no longer reachable at exit are left to the operating system.
atexit.register(gc.freeze)


class ForkServer:
    """The kernel's handle on the server process: spawn ranks, learn their pids and exit codes."""

    def __init__(self, preload: tuple[str, ...] = (), start_timeout: float = SERVER_START_S):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        preload = tuple(preload)
        self.preloaded = set(preload)
        self.proc = subprocess.Popen(
            [sys.executable, "-c",
             f"from course_lib.runtime.forkserver import serve; serve({theirs.fileno()}, {preload!r})"],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C goes to the kernel, which then stops the ranks itself
        )
        theirs.close()
        self.sock = ours
        self.exits: dict[int, int] = {}
        self._pids: dict[int, int] = {}
        self._next_request = 0
        self.lock = threading.RLock()
        msg = recv_msg(ours)[0] if readable(ours, start_timeout) else None
        if not msg or msg[0] != "ready":
            self.close()
            why = msg[1] if msg else f"it did not answer within {start_timeout:.0f} s"
            raise RuntimeError(f"could not start the rank server: {why}")
        self.started = time.time()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fileno(self) -> int:
        return self.sock.fileno()

    def preload(self, names) -> None:
        """Have the server import ``names`` too (once): every rank forked afterwards finds them imported."""
        missing = tuple(n for n in names if n not in self.preloaded)
        if missing:
            send_msg(self.sock, ("import", missing))
            self.preloaded.update(missing)

    def spawn(self, payload: dict, fds: list[int]) -> int:
        """Fork one rank; returns its pid."""
        request = self._next_request
        self._next_request += 1
        try:
            send_msg(self.sock, dict(payload, request=request), fds)
            while request not in self._pids:
                if not self.pump(timeout=30.0):
                    raise RuntimeError("the rank server stopped answering while starting a rank")
        except KeyboardInterrupt:
            # The stop button between the request and its pid: the rank may exist already, and nobody would end
            # it. Learn its pid (a moment) and end it before the interrupt goes on.
            end = time.monotonic() + 5.0
            while request not in self._pids and time.monotonic() < end and self.pump(timeout=0.1):
                pass
            if request in self._pids:
                end_tree(self._pids.pop(request), polite=False)
            raise
        return self._pids.pop(request)

    def pump(self, timeout: float = 0.0) -> bool:
        """Read every message waiting (pids, exit codes); False if the server is gone."""
        wait = timeout
        while True:
            if not readable(self.sock, wait):
                return True
            msg, _ = recv_msg(self.sock)
            if msg is None:
                return False
            if msg[0] == "pid":
                self._pids[msg[1]] = msg[2]
            elif msg[0] == "exit":
                self.exits[msg[1]] = msg[2]
            wait = 0.0

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            end_tree(self.proc, grace=5.0)  # the server, and any rank its lifeline has not ended yet
            self.proc.wait()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def get_server(preload: tuple[str, ...] = ()) -> ForkServer:
    """The kernel's one server, started on first use and restarted if it died; it imports ``preload`` as well."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            if _server is not None:
                _server.close()
            _server = ForkServer(preload)
        else:
            _server.preload(preload)
        return _server


def start_early(preload: tuple[str, ...] = ()) -> None:
    """In a notebook's kernel, start the server in the background as soon as the launcher is imported.

    The server's own torch import (about a second on 2 cores) then runs beside the rest of the notebook's first cell
    instead of inside its first launch; ``get_server``'s lock makes that launch wait for a start still under way. A
    start that fails here is silent: the launch starts the server again and says why it cannot.
    """
    if "ipykernel" not in sys.modules or sys.platform == "win32" or "COURSE_DEVICE" in os.environ:
        return    # a script or test starts it at its first launch; a rank (COURSE_DEVICE) never starts ranks

    def start() -> None:
        try:
            get_server(preload)
        except Exception:
            pass

    threading.Thread(target=start, name="course_lib-server-start", daemon=True).start()


def shutdown() -> None:
    """Stop the server (its ranks die with it through the lifeline)."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None
