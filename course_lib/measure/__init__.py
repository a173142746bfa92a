"""Measuring what a rank does: its messages, its collectives, its time and its memory (notebooks 08-13).

intercept: hooks on this rank's point-to-point calls; traffic: bytes per step counted through them; netem: a slow
link emulated through them; comm_log: every collective a rank runs (ours, FSDP2's, DTensor's) with its bytes;
timeline: labelled regions from torch.profiler as per-rank lanes; memory: bytes a rank holds by category, and the
ZeRO paper's formulas. The algorithms these measure live in course_lib.training. Submodules are imported on use:
comm_log's first use costs seconds per rank (it imports torch._dynamo), and the fork server preloads it only for
kernels that imported it.
"""
