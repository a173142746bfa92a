"""The course's collectives built from point-to-point only (notebooks/06_build_your_own_collectives.ipynb).

Each works on the default process group, in place, for any world size >= 1 (the hierarchical one: whole nodes) and
any tensor size, counts the bytes this rank sends and receives when given a `Traffic`, and records a step trace
when given a `Trace`.
"""

from .hierarchical import hierarchical_all_reduce
from .p2p import Traffic, exchange
from .rabenseifner import rabenseifner_all_reduce
from .recursive_doubling import recursive_doubling_all_reduce
from .ring import chunk_bounds, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .star import star_all_reduce
from .trace import Trace, merge
from .tree import tree_all_reduce

ALL_REDUCE = {
    "ring": ring_all_reduce,
    "tree": tree_all_reduce,
    "recursive_doubling": recursive_doubling_all_reduce,
    "rabenseifner": rabenseifner_all_reduce,
    "star": star_all_reduce,
}

__all__ = ["Traffic", "Trace", "merge", "exchange", "chunk_bounds", "ring_all_reduce", "ring_reduce_scatter",
           "ring_all_gather", "tree_all_reduce", "recursive_doubling_all_reduce",
           "rabenseifner_all_reduce", "hierarchical_all_reduce", "star_all_reduce", "ALL_REDUCE"]
