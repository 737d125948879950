"""User errors: what a person did wrong, where, and what to do about it.

Every mistake in an input file or on the command line becomes a :class:`Problem`
(``file: field: problem (got value)`` plus a hint). The CLI prints them all and exits with
status 2, never a traceback: the person needs the field, not our stack. One kind is no mistake:
a job that would fit but finds what it needs held by other jobs (``busy`` problems) exits 75,
so that a script can tell "try again later" from "fix your file".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from orchestrate.core.exits import EXIT_BUSY, EXIT_SETUP, EXIT_USER_ERROR

__all__ = ["EXIT_BUSY", "EXIT_SETUP", "EXIT_USER_ERROR", "Problem", "UserError", "show_value"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one field of one input."""

    message: str
    source: str = ""  # the file (or "--set", or "command line")
    field: str = ""  # dotted path, e.g. "resources.nodes"
    line: int | None = None
    got: str | None = None  # the offending value, already shortened for display
    hint: str = ""
    #: Not a mistake: what the job needs (GPUs, CPU slots, its port) is held by other jobs now,
    #: and the same request may succeed later.
    busy: bool = False
    #: Not a mistake either: the machine is set up so that orchestrate cannot run safely (a
    #: lease book another user could subvert); whoever runs it fixes it once.
    setup: bool = False

    def render(self) -> str:
        """``file:line: field: message (got value)`` and, on its own line, the hint."""
        where = self.source
        if where and self.line is not None:
            where = f"{where}:{self.line}"
        parts = [p for p in (where, self.field) if p]
        text = ": ".join([*parts, self.message])
        if self.got is not None:
            text += f" (got {self.got})"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class UserError(Exception):
    """One or more problems with what the user gave us; the CLI exits with
    :attr:`exit_status` on it."""

    def __init__(self, problems: Problem | Iterable[Problem]) -> None:
        self.problems: tuple[Problem, ...] = (
            (problems,) if isinstance(problems, Problem) else tuple(problems)
        )
        super().__init__("\n".join(p.render() for p in self.problems))

    @property
    def exit_status(self) -> int:
        """75 (:data:`EXIT_BUSY`) when every problem is that other jobs hold what the job
        needs; 78 (:data:`EXIT_SETUP`) when the others are the machine's setup; else 2: a
        mistake among them is to be fixed first."""
        if self.problems and all(p.busy for p in self.problems):
            return EXIT_BUSY
        if self.problems and all(p.busy or p.setup for p in self.problems):
            return EXIT_SETUP
        return EXIT_USER_ERROR

    @classmethod
    def single(
        cls,
        message: str,
        *,
        source: str = "",
        field: str = "",
        got: object = None,
        hint: str = "",
        line: int | None = None,
        busy: bool = False,
        setup: bool = False,
    ) -> UserError:
        """Build an error with one problem; ``got`` is shown with :func:`show_value`."""
        return cls(
            Problem(
                message,
                source=source,
                field=field,
                line=line,
                got=None if got is None else show_value(got),
                hint=hint,
                busy=busy,
                setup=setup,
            )
        )


def show_value(value: object, limit: int = 60) -> str:
    """A short, unambiguous rendering of a value for an error message."""
    text = repr(value) if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text
