"""The runtime's shared parts: how every process the course starts is ended, watched and asked where it is stuck.

docs/ARCHITECTURE.md, sections 3-7, draws the runtime; run(), persistent ranks, the torchrun labs and the grader
all end their processes with ending.py and report a hang with stacks.py.
"""
