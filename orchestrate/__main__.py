"""``python -m orchestrate`` is the ``orchestrate`` command."""

from orchestrate.cli import entry

entry()
