"""How the kernel, the rank server and the ranks talk: message framing, and every time and code the runtime agrees on.

docs/ARCHITECTURE.md draws the whole protocol; each constant below says why it has its value.
"""

from __future__ import annotations

import pickle
import socket
import struct

# ---------------------------------------------------------------- framing of control messages
# Kernel <-> rank server and kernel <-> persistent rank: a 4-byte big-endian length, then a pickle. File
# descriptors (a rank's pipes) ride along with the first bytes of a message (SCM_RIGHTS on a Unix socket).
HEADER = struct.Struct("!I")
MAX_FDS = 8  # a rank is handed 3 descriptors; the rest is headroom

# ---------------------------------------------------------------- the result pipe of a one-shot rank
STARTED = b"S"  # written when the learner's function begins: from then on a failure is never retried
# What follows (transfer.py) is one frame: an 8-byte length, then the pickle and the tensors' bytes.

# ---------------------------------------------------------------- exit codes of a rank process
EXIT_OK = 0
EXIT_RAISED = 1  # the function (or joining the group) raised; the exception travelled in the result
EXIT_CHILD_BROKEN = 70  # the forked child failed before its entry point returned (sysexits' EX_SOFTWARE)
EXIT_ORPHANED = 75  # the rank server (so the kernel) is gone: the lifeline read EOF (sysexits' EX_TEMPFAIL)

# ---------------------------------------------------------------- times, in seconds
# The whole launch ends WATCH_SLACK_S after ``timeout``: every collective is bounded by ``timeout`` too, so the
# process group's own timeout fires first and names the call that waited, which our deadline could not.
WATCH_SLACK_S = 5.0
# A persistent rank's cell: after the first failure, the others get ``timeout`` plus this to come back (a peer
# waiting in a collective is released by the collective timeout), then the group is restarted.
CELL_SLACK_S = 10.0
# After the first failure, the other ranks may still report their own error during this grace (the teaching
# mode raises on every rank within milliseconds); then they are stopped.
STOP_GRACE_S = 0.3
# SIGTERM first (the polite signal: a rank's code may handle it to clean up), SIGKILL this much later for a rank
# that handles or ignores it. SIGINT is not enough: a rank blocked in a C++ collective never returns to Python to
# act on it.
TERM_TO_KILL_S = 1.0
# After SIGKILL the kernel waits this long for the server to report each exit (a process in uninterruptible
# sleep can take a moment); past it the launch gives up waiting rather than hang the cell.
KILL_WAIT_S = 5.0
# A rank that exited may have started children that still hold its pipes open; its output is considered
# complete this long after its exit even without EOF.
DRAIN_S = 1.0
# A %%ranks cell's own deadline unless the cell or the group says otherwise (%%ranks --timeout S, Ranks(cell_timeout=)):
# long enough for a lesson's training cell on 2 cores, short enough that an endless loop ends while one watches.
CELL_TIMEOUT_S = 120.0
# A persistent rank asked to exit (between cells) gets this long before SIGTERM.
ASK_EXIT_S = 1.0
# After relaying a stop press to persistent ranks: a rank still busy after this is blocked in C++ (a collective
# or recv waiting for a peer) and cannot be interrupted, so the group is restarted.
INTERRUPT_GRACE_S = 2.0
# Joining the process group can fail for reasons outside the learner's code (gloo's connectFullMesh was refused
# about once in a few hundred launches under load). Before the learner's function starts on any rank, starting
# again is safe; after that, never.
SETUP_ATTEMPTS = 3
# The rank server imports torch (1-3 s) before it answers; a machine under load gets this long.
SERVER_START_S = 120.0


def send_msg(sock: socket.socket, obj, fds=()) -> None:
    """One framed message, with ``fds`` passed along (the receiver gets its own copies of them)."""
    data = pickle.dumps(obj)
    msg = HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [msg], list(fds)) if fds else sock.send(msg)
    if sent < len(msg):
        sock.sendall(msg[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            return None
        got += k
    return buf


def recv_msg(sock: socket.socket):
    """One framed message and the fds that came with its first bytes; (None, []) at EOF."""
    head, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, MAX_FDS)
    if not head:
        return None, []
    if len(head) < HEADER.size:
        rest = _recv_exact(sock, HEADER.size - len(head))
        if rest is None:
            return None, fds
        head += rest
    (n,) = HEADER.unpack(head)
    body = _recv_exact(sock, n)
    return (None if body is None else pickle.loads(body)), fds
