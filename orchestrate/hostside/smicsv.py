"""Reading ``nvidia-smi``'s CSV: its rows by field name, and its cells as text or numbers, in
one place.

Every reader of nvidia-smi output reads the same markers: ``[N/A]``, ``[Not Supported]``,
``N/A`` and an empty cell mean "no value", and ``81920 MiB`` is the number 81920. The runner
(:mod:`orchestrate.hostside.smi`), the usage and health gatherers on every host, the probe's
fact parser and the pure health verdicts (:mod:`orchestrate.core.gpuhealth`, which must load no
process code) all read cells here, so a marker one of them learns is learnt by all, and a GPU's
model, memory or error count reads the same wherever it is shown or judged.

Pure (no process is started, nothing is read), standard library only, Python 3.8+: shipped
inside the SSH agent, the watchdog and the fact gatherer with :mod:`orchestrate.hostside.smi`.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False  # typing costs start-up time on every host; only the checker needs it
if TYPE_CHECKING:
    from typing import Sequence

#: A header cell's unit: ``memory.total [MiB]`` names the field ``memory.total``.
_UNITS = re.compile(r"\s*\[.*\]$")
_LEADING_NUMBER = re.compile(r"^-?\d+(\.\d+)?")
#: What nvidia-smi prints for a field without a value, besides ``[...]`` and an empty cell.
_NOT_AVAILABLE = ("N/A", "n/a")


def rows(text: str, fields: Sequence[str] | None = None) -> list[dict[str, str]]:
    """The rows of ``--format=csv[,noheader][,nounits]`` text, each as field -> stripped cell.

    With a header (its units dropped: ``memory.total [MiB]``) the fields are the header's,
    unless ``fields`` (what was asked, in order) names them: nvidia-smi heads some fields with
    another name (``used_memory`` as ``used_gpu_memory``). Without a header, ``fields`` names
    the columns. The last column keeps any commas (a ``process_name`` may hold one: ask it
    last); a row with too few cells is left out."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = [_UNITS.sub("", c.strip()) for c in lines[0].split(",")]
    names = list(fields or header)
    if not fields or set(header) & set(fields):
        lines = lines[1:]
        if len(header) != len(names):
            names = header
    found = []
    for line in lines:
        cells = [c.strip() for c in line.split(",", len(names) - 1)]
        if len(cells) == len(names):
            found.append(dict(zip(names, cells)))
    return found


def value(cell: str | None) -> str | None:
    """A cell, or None for nvidia-smi's not-available markers (``[N/A]``, ``[Not Supported]``,
    ``N/A``, empty)."""
    if cell is None:
        return None
    cell = cell.strip()
    if not cell or (cell.startswith("[") and cell.endswith("]")) or cell in _NOT_AVAILABLE:
        return None
    return cell


def number(cell: str | None) -> float | None:
    """A cell's leading number (``81920``, ``81920 MiB``), or None where there is none."""
    text = value(cell)
    found = _LEADING_NUMBER.match(text) if text is not None else None
    return float(found.group(0)) if found else None


__all__ = ["number", "rows", "value"]
