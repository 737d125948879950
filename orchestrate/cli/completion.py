"""Shell completion of job references: the ids and names in this user's job store.

click completes commands and options by itself (``_ORCHESTRATE_COMPLETE=bash_source
orchestrate``: README, "Shell completion"); an argument that names a job (``logs``, ``status``,
``cancel``, ...) has no fixed choices, so this reads the job store for them: the recent jobs'
ids and names (a name stands for its latest job, as :meth:`~orchestrate.run.store.Store.resolve`
reads it), newest first, each with its state as the help zsh and fish show. ``cancel`` is
offered only the jobs that still run. Completion must never print an error into the user's
prompt, so a store that cannot be read completes nothing.
"""

from __future__ import annotations

import contextlib

import click
from click.shell_completion import CompletionItem

#: How many recent jobs are offered (a store of years of jobs stays quick to complete).
RECENT = 200


def _items(incomplete: str, active_only: bool) -> list[CompletionItem]:
    from orchestrate.run.store import Store

    items: list[CompletionItem] = []
    names: set[str] = set()
    with contextlib.suppress(Exception):  # never a traceback at the prompt
        for job in Store().list(RECENT, active_only=active_only):
            if job.id.startswith(incomplete):
                items.append(CompletionItem(job.id, help=f"{job.name} {job.state}"))
            if job.name.startswith(incomplete) and job.name not in names:
                names.add(job.name)
                items.append(CompletionItem(job.name, help=f"latest: {job.id} {job.state}"))
    return items


def jobs(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Every recent job's id and name that starts with ``incomplete``."""
    return _items(incomplete, active_only=False)


def running_jobs(ctx: click.Context, param: click.Parameter,
                 incomplete: str) -> list[CompletionItem]:
    """The same, of the jobs that have not ended (what ``cancel`` can stop)."""
    return _items(incomplete, active_only=True)
