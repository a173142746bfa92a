"""Measuring what a rank does: its messages, its collectives, its time and its memory (notebooks 08-15).

- recorder: the one record of every c10d operator a rank calls (collectives and messages), read through the one
  operator table c10d_ops; comm_log (every collective with its bytes, 05, 12, 13), alltoall_log (what each
  all-to-all sends to and receives from every peer, 15) and the checkers' Watch are views of it; collective_calls
  runs it around each dist.* collective, so calls from hooks on gloo's threads are seen too (11b).
- intercept: hooks on this rank's point-to-point calls that act when a message completes; traffic: bytes per step
  counted through them (08, 10); emulated_link: a slow link emulated through them, on a virtual clock; nccl_tests: reads
  nccl-tests output text (07).
- timeline: labelled regions from torch.profiler as per-rank lanes; bubble: a pipeline's idle share read off the
  ranks' recorded timelines and replayed (14).
- memory: bytes a rank holds by category, and the ZeRO paper's formulas; activations: bytes autograd saves for
  backward, per layer (14); peak_memory: the most memory a call's tensors held at once (15).

The algorithms these measure live in course_lib.training. Submodules are imported on use. The dispatch modes of
recorder and peak_memory opt out of torch's dynamo guard (``_should_skip_dynamo``), whose first use
imports torch._dynamo (seconds per rank), so a kernel that imports them keeps the rank server's fast start
(course_lib.runtime.rank_process.rank_preloads).
"""
