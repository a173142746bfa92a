"""torchrun-ready entry points: `torchrun --standalone --nproc-per-node=N -m course_lib.labs.<name> ...`."""
