"""A check per column, a host per row: what a backend found on the hosts before launching.

The SSH backend's preflight fills one (:func:`orchestrate.backends.ssh.preflight.host_table`);
its supervisor sends it back to ``submit`` inside the refusal
(:class:`~orchestrate.backends.handshake.Verdict`), and ``submit`` prints it, so the table a
user reads is the same whether the dry run or a refused submit made it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HostRow:
    """One host: its label, a cell per column, and the columns that failed there."""

    label: str
    cells: tuple[str, ...]
    failed: frozenset[str] = frozenset()


@dataclass(frozen=True)
class HostTable:
    """The per-host table: its title, its columns, a row per host."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[HostRow, ...]

    def to_json(self) -> dict[str, Any]:
        """As JSON values (the verdict line)."""
        return {
            "title": self.title,
            "columns": list(self.columns),
            "rows": [{"label": r.label, "cells": list(r.cells), "failed": sorted(r.failed)}
                     for r in self.rows],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HostTable:
        """The inverse of :meth:`to_json`."""
        return cls(
            title=str(data["title"]),
            columns=tuple(data["columns"]),
            rows=tuple(HostRow(str(r["label"]), tuple(r["cells"]), frozenset(r["failed"]))
                       for r in data["rows"]),
        )

    def render(self, only_failed: bool) -> Any:
        """A rich table (failed cells in red); with ``only_failed``, the hosts that failed."""
        from rich.markup import escape
        from rich.table import Table

        shown = [r for r in self.rows if not only_failed or r.failed]
        title = f"{self.title}: what failed" if only_failed else self.title
        if only_failed and len(shown) < len(self.rows):
            title += f" ({len(self.rows) - len(shown)} other host(s) passed)"
        grid = Table(title=title, title_justify="left")
        grid.add_column("host")
        for column in self.columns:
            grid.add_column(column, overflow="fold")
        for row in shown:
            grid.add_row(row.label, *(
                f"[red]{escape(text)}[/]" if column in row.failed else escape(text)
                for column, text in zip(self.columns, row.cells, strict=True)))
        return grid

    def print(self, only_failed: bool) -> None:
        """Print it on stderr (wide when stderr is not a terminal, so a log keeps every cell)."""
        import sys

        from rich.console import Console

        Console(file=sys.stderr, width=200 if not sys.stderr.isatty() else None).print(
            self.render(only_failed))
