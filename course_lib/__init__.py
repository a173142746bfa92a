"""course_lib: the helper library of the distributed-training course; notebooks import it next to torch."""

from .devices import LaunchError, device, plan
from .launch import run
from .results import RankFailed, RankTimeout, RunResult

__all__ = ["run", "device", "plan", "LaunchError", "RankFailed", "RankTimeout", "RunResult"]
__version__ = "0.1.0"
