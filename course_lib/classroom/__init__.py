"""Classroom tools: student copies, grading, nbgrader marks, the static site, export, the doctor."""
