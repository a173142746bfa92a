"""Exercise checkers: run the learner's function on real ranks against torch's own op and explain any difference."""

from .core import ExerciseFailed, check_collective

__all__ = ["ExerciseFailed", "check_collective"]
