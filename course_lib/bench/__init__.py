"""Benchmarks the course keeps: `python -m course_lib bench ...`."""
