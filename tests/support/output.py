"""A job's merged output, read the way ``orchestrate logs`` reads it (for tests that check the
merged view of a run directory: the bytes are in the rank files, the order in ``output.idx``)."""

from __future__ import annotations

from pathlib import Path

from orchestrate.core.layout import MERGED_INDEX
from orchestrate.hostside.outputlog import View


def merged_bytes(run_dir: Path) -> bytes:
    """The merged view of the run directory, as ``orchestrate logs JOB`` prints it to a pipe."""
    return b"".join(View(str(Path(run_dir) / MERGED_INDEX)).lines())


def merged_text(run_dir: Path) -> str:
    """The merged view as text (what the tests read ``output.log`` for before it was derived)."""
    return merged_bytes(run_dir).decode("utf-8", errors="replace")
