"""The run report: the run directory's files in, one self-contained HTML page out.

Pure: :mod:`.runfiles` reads a run directory into :class:`~.rundata.RunData` (its records:
the plan, the diagnoses, the attempts, :mod:`.metricrecord`), :mod:`.straggler` computes
per-rank pace, :mod:`.scales` and :mod:`.svg` draw, :mod:`.html` lays the page out
(:mod:`.bandwidth`: the doctor's charts).
"""
