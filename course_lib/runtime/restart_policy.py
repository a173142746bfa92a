"""After a persistent group's cell failed or was interrupted: can the group go on, must it be restarted, and what
the cell says about it. The policy of persistent_ranks.py; docs/ARCHITECTURE.md explains the cases."""

from __future__ import annotations

from dataclasses import dataclass

from .rank_failure import PEER_NOISE, names

# After a timeout gloo closes the pairs it timed out on ("Application timeout caused pair closure"): every later
# collective of the group fails, and the tensor of a rank that timed out may hold a partial result.
BROKEN_BY = ("Timed out", "pair closure", *PEER_NOISE)
RESTART = "%ranks restart (or .restart()) starts a fresh group; every rank's variables are lost."


@dataclass
class Verdict:
    """What becomes of the group: restart it now, or mark it broken (the next cell refuses at once), and why."""

    restart: bool = False
    broken: str = ""
    note: str = ""


def after_cell(failures, stuck: list[int], timeout: float, slack: float, backend: str = "gloo",
               finished: list[int] = ()) -> Verdict:
    """The verdict after a cell in which ``failures`` happened, the ranks ``stuck`` never answered and the ranks
    ``finished`` ran it to its end, on ``backend``."""
    if stuck:
        return Verdict(restart=True, note=(
            f"{names(stuck).capitalize()} stayed blocked {timeout + slack:g} s after the first failure, so the "
            "group was restarted: new processes, every rank's variables are gone."))
    if any(f.kind != "raised" for f in failures):
        return Verdict(broken="a rank's process died",
                       note="A rank's process died, so the group cannot go on: " + RESTART)
    stranded = sorted(f.rank for f in failures if f.etype == "NcclRuleBroken" and "'p2p-order'" in f.message)
    if stranded:
        # the mode raised while gloo still held the posted sends and receives of the cycle: a later cell's message
        # between those ranks would be matched with them
        return Verdict(broken=f"{names(stranded)} left sends or receives posted when the NCCL rules stopped them",
                       note=("The NCCL rules stopped a cycle of waiting ranks; their posted sends and receives are "
                             "still pending in gloo and would catch a later cell's messages. The group is marked "
                             "broken: " + RESTART))
    timed_out = sorted(f.rank for f in failures
                       if f.etype != "KeyboardInterrupt" and any(sign in f.message for sign in BROKEN_BY))
    if timed_out:
        its = "its tensor" if len(timed_out) == 1 else "their tensors"
        return Verdict(
            broken=f"{names(timed_out)} gave up waiting in a collective, and gloo closed those connections",
            note=(f"{names(timed_out).capitalize()} gave up waiting in a collective: {its} may hold a partial "
                  "result, and gloo closes its connections after a timeout, so this group's collectives would fail "
                  "from now on. The group is marked broken: " + RESTART))
    if failures and backend == "nccl" and finished:
        return Verdict(note=nccl_queued(sorted({f.rank for f in failures}), list(finished), timeout))
    if failures:
        return Verdict(note="The other ranks' variables are kept; fix the cell and run it again.")
    return Verdict()


def nccl_queued(failed: list[int], finished: list[int], timeout: float) -> str:
    """On NCCL a collective returns once it is queued on the GPU, so ranks that finished a cell in which another
    rank failed may hold a collective that can never complete; at the timeout torch's watchdog ends them
    (TORCH_NCCL_ASYNC_ERROR_HANDLING, default 3, ProcessGroupNCCL.hpp)."""
    return (f"On NCCL a collective returns once it is queued on the GPU: one that {names(finished)} called in this "
            f"cell is still waiting there for {names(failed)}, and shortly after the {timeout:g} s timeout NCCL's "
            "watchdog ends their processes. If the cell called a collective, run "
            "%ranks restart now and do not rerun the cell (its first collective would meet the queued one); if it "
            "called none, the other ranks' variables are kept: fix the cell and run it again.")


def after_interrupt(stuck: list[int], interrupted: list[int]) -> Verdict:
    """The verdict after the stop button: ranks still blocked in C++ cannot be interrupted, so restart."""
    if stuck:
        return Verdict(restart=True, note=(
            f"{names(stuck)} stayed blocked inside C++ (a collective or recv waiting for a peer), so the group was "
            "restarted: new processes, every rank's variables are gone."))
    return Verdict(note=f"interrupted {names(interrupted)}; every rank keeps its variables.")


def still_running(failed: int, waiting: list[int], timeout: float) -> str:
    """What the cell prints at the first failure while other ranks are still busy (named)."""
    verb = "is" if len(waiting) == 1 else "are"
    return (f"[course_lib] rank {failed} failed; {names(waiting)} {verb} still running. If they wait for rank "
            f"{failed} in a collective, the {timeout:g} s timeout releases them (or press stop to restart the group "
            "now).")


def refusal(broken: str) -> str:
    """What a cell on a broken group says at once, instead of failing in gloo."""
    return f"the group cannot run cells ({broken}). " + RESTART
