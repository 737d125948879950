"""The run report: the run directory's files in, one self-contained HTML page out.

Pure: :mod:`.runfiles` reads a run directory into :class:`~.runfiles.RunData`, :mod:`.straggler`
computes per-rank pace, :mod:`.svg` draws, :mod:`.html` lays the page out.
"""
