"""Which Slurm a cluster runs, asked once per cluster, and what that release can do.

Clusters run anything from 20.11 to 25.11, and a flag one release added is an error in an older
one (sbatch exits 1 on an option it does not know). So every option newer than 20.11 goes
through here: :func:`cluster_version` asks ``sbatch --version`` once per cluster (its
``SLURM_CONF``) and keeps the answer for the process; :func:`requeue_options` and friends turn
the version into the options that release accepts. The per-release differences the parsers
handle are in docs/slurm.md ("Slurm releases").
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

from orchestrate.backends.slurm.ctl import SlurmClient, SlurmError

_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True, order=True)
class SlurmVersion:
    """A Slurm release, ``22.05.8`` as (22, 5, 8); ordered, so ``v >= EXPEDITE`` reads well."""

    major: int
    minor: int
    micro: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor:02d}.{self.micro}"


#: ``sbatch --requeue=expedite`` (and ``ExpeditedRequeue=`` in ``scontrol show job``).
EXPEDITE = SlurmVersion(25, 11)
#: ``ReqTRES=``/``AllocTRES=`` in ``scontrol show job`` instead of one ``TRES=``.
ALLOC_TRES_IN_SHOW_JOB = SlurmVersion(23, 2)
#: ``scontrol``/``squeue``/``sinfo --json`` (data_parser); 20.11 refuses the option.
JSON_OUTPUT = SlurmVersion(21, 8)


def parse_version(text: str) -> SlurmVersion | None:
    """``slurm 22.05.8`` (``sbatch --version``), ``slurm-wlm 24.11.5``, ``SLURM_VERSION =
    25.11.0-0rc1`` or ``Version=23.02.7`` as a version; None for text without one."""
    match = _VERSION.search(text)
    if match is None:
        return None
    return SlurmVersion(int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))


_CACHE: dict[str, SlurmVersion | None] = {}
_LOCK = threading.Lock()


def cluster_version(client: SlurmClient) -> SlurmVersion | None:
    """The Slurm release of the client's cluster (``sbatch --version``), asked once per
    cluster (its ``SLURM_CONF``) in this process; None when sbatch does not answer or prints
    no version (then no option newer than 20.11 is used)."""
    env = os.environ if client.env is None else client.env
    key = env.get("SLURM_CONF", "")
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    try:
        done = client.run("sbatch", "--version")
        found = parse_version(done.stdout) if done.returncode == 0 else None
    except SlurmError:
        found = None
    with _LOCK:
        _CACHE[key] = found
    return found


def forget_versions() -> None:
    """Drop the cached versions (a cluster upgraded under a long-lived process; tests)."""
    with _LOCK:
        _CACHE.clear()


def expedite(version: SlurmVersion | None) -> bool:
    """Whether the release takes ``--requeue=expedite``: a requeued job eligible at once, at
    the top of the queue (25.11; it acts only where slurm.conf has
    ``SlurmctldParameters=enable_expedited_requeue``, and is ignored elsewhere)."""
    return version is not None and version >= EXPEDITE


def requeue_options(version: SlurmVersion | None, requeue: bool) -> tuple[str, ...]:
    """The sbatch command-line options that ask for an expedited requeue where the release has
    it: ``("--requeue=expedite",)`` on >= 25.11 for a job that may be requeued, else nothing
    (the script's own ``#SBATCH --requeue``/``--no-requeue`` stands; command-line options
    override ``#SBATCH`` lines)."""
    return ("--requeue=expedite",) if requeue and expedite(version) else ()
