"""The real Slurm test cluster (tests/clusters/slurm.sh): what a test needs to talk to it, and
its bring-up, the body of the session fixture ``slurm_cluster`` (tests/conftest.py).

Why a fixture that brings the cluster up itself: the Slurm tests must prove the backend works
against real slurmctld/slurmd daemons, so a missing cluster is a failure, never a skip. A cluster
that was already up before the session (a developer's `slurm.sh up`) is used and left running.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrate.backends.slurm.ctl import parse_show_job

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "clusters" / "slurm.sh"
STATE_DIR = Path(os.environ.get("ORCHESTRATE_SLURM_DIR", "/tmp/orchestrate-slurm"))

#: Slurm job states after which a job never runs again (requeue aside).
FINISHED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


#: The releases the Slurm tests run on: this machine's (Debian 12: 22.05) and Debian 13's 24.11
#: from its own root (tests/clusters/slurm-root.sh), the second cluster (``slurm_cluster_2411``).
HOST_RELEASE, SECOND_RELEASE = "22.05", "24.11"
#: slurm.sh's ORCHESTRATE_SLURM_RELEASE and state dir for the second release.
SECOND = {"ORCHESTRATE_SLURM_RELEASE": "2411"}
SECOND_DIR = Path(os.environ.get("ORCHESTRATE_SLURM2411_DIR", "/tmp/orchestrate-slurm2411"))
SLURM_ROOT = Path(os.environ.get("ORCHESTRATE_SLURM_ROOT", "/var/cache/orchestrate/slurm-trixie"))
ROOT_SCRIPT = REPO / "tests" / "clusters" / "slurm-root.sh"
#: How long a session waits for the root that .ci/run builds in the background.
ROOT_WAIT_S = 180


#: ``@BOTH_RELEASES``: a test (one that takes ``ocli``) runs on 22.05 and on 24.11. The 24.11
#: case carries the ``slurm_release`` mark: its own xdist group (tests/support/tiers.py), so
#: the second cluster's tests run on one worker, beside the first cluster's.
BOTH_RELEASES = pytest.mark.parametrize(
    "slurm_release", [HOST_RELEASE, pytest.param(SECOND_RELEASE, marks=pytest.mark.slurm_release)],
    indirect=True)


@dataclass(frozen=True)
class SlurmCluster:
    """What a test needs to talk to the cluster: the clients' env, the nodes, the state dir."""

    state_dir: Path
    nodes: tuple[str, ...]
    env: dict[str, str]  # os.environ plus SLURM_CONF (from $state_dir/env.sh)
    layout: str  # "netns": one network namespace per node; "loopback": 127.0.1.K addresses
    release: str = HOST_RELEASE  # "22.05" (this machine's Slurm) or "24.11" (its own root)

    @property
    def slurm_conf(self) -> Path:
        return Path(self.env["SLURM_CONF"])

    def run(
        self, *args: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (sbatch, scontrol, ...) against this cluster."""
        return subprocess.run(
            args, env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def sbatch(self, script: Path, *options: str) -> str:
        """Submit a batch script; return the job id."""
        self.heal()
        out = self.run("sbatch", "--parsable", *options, str(script)).stdout.strip()
        return out.split(";")[0]

    def heal(self) -> None:
        """Resume a node slurmd drained because an earlier test's step did not end within
        UnkillableStepTimeout ("Kill task failed"), so one stuck step fails its own test, not
        every later one. Said on stderr (pytest shows it with the test), never silent."""
        listing = self.run("sinfo", "-h", "-N", "-o", "%N|%T|%E", check=False).stdout
        drained = sorted({line.split("|")[0] for line in listing.splitlines()
                          if line.count("|") == 2 and "Kill task failed" in line.split("|")[2]})
        for node in drained:
            print(f"slurm test cluster: resuming {node}, drained by slurmd (Kill task failed)",
                  file=sys.stderr)
            self.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        deadline = time.monotonic() + 30
        while drained and time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
            if all(states[states.index(n) + 1] in ("idle", "mixed", "allocated")
                   for n in drained if n in states):
                return
            time.sleep(0.5)

    def quiet(self, timeout: float = 120) -> None:
        """Wait until no job of an earlier test is still running or completing, then heal: a
        test that stops the controller must not catch a step ending. Its completion messages
        then fail, slurmstepd gives up after UnkillableStepTimeout and drains the nodes ("Kill
        task failed"), and the next test's job pends on them (CI, stop 42)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = self.run("squeue", "-h", "-t", "R,CG,CF,S", "-o", "%i %T",
                            check=False).stdout.split()
            if not busy:
                break
            time.sleep(0.5)
        self.heal()

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict; works after the job ended (MinJobAge=3600)."""
        text = self.run("scontrol", "show", "job", job_id).stdout
        records = parse_show_job(text)  # a job name or comment may hold " JobState=..."
        return next((r for r in records if r.get("JobId") == job_id), {})

    def wait(
        self, job_id: str, until: frozenset[str] = FINISHED, timeout: float = 60
    ) -> dict[str, str]:
        """Poll `scontrol show job` until the job's state is in `until`; return its fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in until:
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} not in {sorted(until)} after {timeout}s: {fields}"
                )
            time.sleep(0.2)


def _script(command: str, timeout: float,
            extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = None
    if extra:
        env = {**os.environ, **extra, "ORCHESTRATE_SLURM_DIR": str(SECOND_DIR)}
    return subprocess.run(
        [str(SCRIPT), command], capture_output=True, text=True, timeout=timeout, check=False,
        env=env,
    )


def _read_env_sh(path: Path) -> dict[str, str]:
    """The `export NAME=value` lines that slurm.sh writes, without running a shell."""
    exported: dict[str, str] = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, _, value = words[1].partition("=")
            exported[name] = value
    return exported



def _building() -> bool:
    """Whether ``slurm-root.sh root`` is building the root now (its PID in ``ROOT.building``)."""
    try:
        os.kill(int(Path(f"{SLURM_ROOT}.building").read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


def root_ready() -> str | None:
    """None once the second release's root is built; else why not. A build under way (.ci/run
    starts ``slurm-root.sh root`` in the background) is waited for, up to ROOT_WAIT_S."""
    base = Path(sys.base_prefix)
    if base.parts[1:2] == ("usr",) and base.parts[2:3] != ("local",):
        # The root has its own /usr (Debian 13's): the machine's /usr/bin/python3 is not in it.
        return (f"this Python ({sys.base_prefix}) is under /usr, which the 24.11 root replaces: "
                "its jobs need a Python outside /usr (a pyenv, /usr/local or /opt build)")
    deadline = time.monotonic() + ROOT_WAIT_S
    while not (SLURM_ROOT / ".orchestrate-slurm-root").exists():
        if not _building() or time.monotonic() > deadline:
            log = Path(f"{SLURM_ROOT}.log")
            tail = log.read_text(errors="replace")[-600:] if log.exists() else ""
            return (f"no Slurm 24.11 root at {SLURM_ROOT} (build it: {ROOT_SCRIPT} root)"
                    + (f"; its build log ends: {tail}" if tail else ""))
        time.sleep(2)
    return None


def cluster_up(second: bool = False) -> Iterator[SlurmCluster]:
    """The test cluster for the whole session: brought up unless it already was, and then
    brought down again. ``second``: the Slurm 24.11 cluster (skipped, loudly, without its
    root)."""
    extra = SECOND if second else None
    state_dir = SECOND_DIR if second else STATE_DIR
    if second and (why := root_ready()) is not None:
        print(f"\nSLURM 24.11 TESTS SKIPPED: {why}", file=sys.stderr)
        warnings.warn(f"Slurm 24.11 tests skipped: {why}", pytest.PytestWarning, stacklevel=1)
        pytest.skip(why)
    was_up = _script("status", timeout=30, extra=extra).returncode == 0
    started = time.monotonic()
    up = _script("up", timeout=600, extra=extra)
    if up.returncode != 0:
        pytest.fail(
            f"tests/clusters/slurm.sh up failed (exit {up.returncode}):\n{up.stdout}\n{up.stderr}",
            pytrace=False,
        )
    print(f"\nslurm cluster up in {time.monotonic() - started:.2f}s: {up.stdout.strip()}")
    exported = _read_env_sh(state_dir / "env.sh")
    conf = Path(exported["SLURM_CONF"]).read_text()
    layout = "loopback" if "NodeAddr=127." in conf else "netns"
    env = {**os.environ, **exported}
    if "ORCHESTRATE_SLURM_BIN" in exported:  # the release's clients, first on PATH
        env["PATH"] = f"{exported['ORCHESTRATE_SLURM_BIN']}:{env.get('PATH', '')}"
    try:
        yield SlurmCluster(
            state_dir=state_dir,
            nodes=tuple(exported["ORCHESTRATE_SLURM_NODES"].split()),
            env=env,
            layout=layout,
            release=SECOND_RELEASE if second else HOST_RELEASE,
        )
    finally:
        if not was_up:
            down = _script("down", timeout=120, extra=extra)
            assert down.returncode == 0, f"slurm.sh down failed:\n{down.stdout}\n{down.stderr}"


