"""Exercise checkers: run the learner's function on real ranks, check the result AND the method, explain a failure.

How a checker for a new exercise is written (one module per notebook, named after its topic):

- ``check_collective(exercise, learner, reference, make_input, world_sizes=, sizes=, dtypes=, hint=, forbid=,
  why=, library=, traffic=, in_place=)`` (core.py): one launch per world size runs every (size, dtype) case; on
  every rank the reference first, then the learner's function on the same input. ``forbid`` names the collectives
  switched off while the learner's code runs ("all", "all_reduce", "broadcast", "send_recv", ...; the table is
  c10d_ops.COLLECTIVES; ``c10d_ops.everything_but("all_reduce")`` for an exercise about one of them),
  ``why`` completes the refusal "Exercise 6.1 is about <why>; dist.all_reduce is switched off here.",
  ``library`` lists dotted paths of course functions that hold the answer (switched off the same way),
  ``traffic(case, records)`` returns a message (with the measured figures) when the method is wrong, None when
  right; ``in_place=True`` demands the result in the input tensor itself.
- For an exercise that is not "a tensor in, a tensor out": on each rank, ``watched_call(exercise, fn, args,
  forbid=, why=, library=)`` runs the learner's function watched and returns (its result, this rank's traffic
  record); bring the records back and judge them with ``traffic.summary(record)`` (bytes, messages, peers,
  collective calls with bytes, group size and reduce op) and ``traffic.rounds(records)`` (the longest chain of
  messages that had to wait for each other). ``launch_checked(exercise, fn, world, args=, hint=)`` launches and
  turns a failure into the right error: the student copy's NotImplementedError stays NotImplementedError, a
  switched-off call becomes ExerciseFailed with its sentence, anything else ExerciseFailed naming the rank.
- A learner's function that runs in the notebook's own process (a formula, a command line):
  ``call_learner(exercise, fn, *args, library=, why=, hint=)``.
- Raise ExerciseFailed with ``with_hint(message, hint)``: what was given, what was measured, never the expected
  value itself when it is the answer; end with ``passed(exercise, what)``. The expected value is computed here, so
  the check cell is one call, e.g. ``check_ring_all_reduce(my_ring_all_reduce)``. The exercise id ("Exercise
  6.1") is the default of the checker's ``exercise`` argument and the heading's id in the notebook: the student
  copy, the grader and tests/test_exercises.py read the same id.
"""

from .core import ExerciseFailed, call_learner, check_collective, launch_checked, passed, watched_call, with_hint

__all__ = ["ExerciseFailed", "call_learner", "check_collective", "launch_checked", "passed", "watched_call",
           "with_hint"]
