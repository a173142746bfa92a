"""nbval runs the worked notebooks; the student copies that `python -m course_lib student` writes into
notebooks/student/ stop at their exercises by design, so they are not collected."""

collect_ignore = ["student"]
