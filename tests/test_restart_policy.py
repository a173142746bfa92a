"""What a persistent group says after a rank failed in a cell (restart_policy.py, notebook 05b, section 5)."""

import time

from course_lib.runtime.rank_failure import FailureRecord
from course_lib.runtime.restart_policy import after_cell


def _raised(rank: int, etype: str = "ValueError", message: str = "rank 1 cannot go on") -> FailureRecord:
    return FailureRecord(rank=rank, kind="raised", message=message, time=time.time(), etype=etype)


def test_gloo_keeps_the_group_after_a_rank_raised_while_the_others_finished():
    verdict = after_cell([_raised(1)], [], 5.0, 2.0, "gloo", [0, 2, 3])
    assert not verdict.restart and not verdict.broken
    assert verdict.note == "The other ranks' variables are kept; fix the cell and run it again."
    # the default backend is gloo's: callers that name none keep the old message
    assert after_cell([_raised(1)], [], 5.0, 2.0).note == verdict.note


def test_nccl_says_restart_when_the_others_finished_a_cell_with_a_queued_collective():
    note = after_cell([_raised(1)], [], 5.0, 2.0, "nccl", [0, 2, 3]).note
    assert "ranks 0, 2 and 3 called in this cell is still waiting there for rank 1" in note
    assert "run %ranks restart now and do not rerun the cell" in note
    assert "fix the cell and run it again" in note.split("if it called none")[1]


def test_nccl_with_no_other_rank_in_the_cell_keeps_the_plain_message():
    # %%ranks 1 alone: nothing can be queued on another rank
    assert after_cell([_raised(1)], [], 5.0, 2.0, "nccl", []).note.startswith("The other ranks' variables are kept")


def test_a_timeout_still_breaks_a_gloo_group():
    failures = [_raised(1), _raised(0, "RuntimeError", "Timed out waiting 5000ms for recv operation to complete")]
    verdict = after_cell(failures, [], 5.0, 2.0, "gloo", [])
    assert verdict.broken.startswith("rank 0 gave up waiting")
