"""Testing knobs: production waits that a test may shorten through the environment.

Some waits are long on purpose: the CLI waits 30 s for a locked job store before it says so, a
supervisor notes a rank that finished 10 s before the others. A test that must see such a wait
run out would otherwise sleep that long (40 s and 14 s, for two tests). Each such constant is
read once, through :func:`seconds`, by the process that uses it, when it starts: a test sets the
variable in the environment of the CLI it runs, and the supervisor that CLI starts inherits it.

The knobs (seconds; unset means the production value):

- ``ORCHESTRATE_STORE_PATIENCE_S``: how long a CLI waits for a locked store (30);
- ``ORCHESTRATE_EARLY_EXIT_NOTICE_S``: when a rank that exited 0 before the others is noted
  (10);
- ``ORCHESTRATE_LINGER_SLACK_S``: how long past ``distributed.timeout_s`` ranks may outlive a
  finished rank 0, or hang in their exit once named (30; a Slurm job's watch reads it in the
  batch job, whose environment is the submitting CLI's);
- ``ORCHESTRATE_BLAME_SETTLE_S``: how long a failure that no rank explained yet waits for one
  that explains it (3).

They are for tests, not for tuning a deployment: a job's own timing lives in the job file.
"""

from __future__ import annotations

import math
import os


def seconds(name: str, default: float) -> float:
    """The positive number of seconds in ``$name``, else ``default``. A value that is not one
    raises ValueError naming the variable: a knob set wrong must not pass for the default."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{name}={text!r}: expected a positive number of seconds")
    return value
