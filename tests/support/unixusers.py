"""Real Unix users for the shared-server tests (issue #20), of the local backend and of an SSH
test host: made as root, each running orchestrate under its own uid with an interpreter every
user can execute, removed afterwards.

The test interpreter lives under /root (mode 0700), so another user cannot run it. The shared
one is a venv of the system Python (/usr/bin/python3) holding orchestrate's own dependencies
(PyYAML, pydantic, Jinja2, click, rich: a ``command:`` job needs no torch), made once and kept
under /var/tmp between runs (keyed on the dependencies' versions): when the system Python is
the test interpreter's version, the installed distributions are copied (their RECORD lists
their files; no network, a second or two), else pip installs the same versions. orchestrate
itself comes from this checkout (PYTHONPATH), readable by everyone. The SSH backend's users
need Fabric and paramiko too (``SSH_DEPENDENCIES``): another venv, made the same way.

Users get the password ``*`` (no password works, yet not locked): sshd refuses a key to a
locked account (``!``) unless it uses PAM.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"
DEPENDENCIES = ("PyYAML", "pydantic", "pydantic_core", "annotated-types", "typing_extensions",
                "typing-inspection", "Jinja2", "MarkupSafe", "click", "rich", "markdown-it-py",
                "mdurl", "Pygments")
#: What the SSH backend adds (the supervisor logs in with Fabric).
SSH_DEPENDENCIES = ("fabric", "paramiko", "invoke", "bcrypt", "cryptography", "PyNaCl", "cffi",
                    "pycparser", "decorator", "Deprecated", "wrapt")
VENVS = Path("/var/tmp/orchestrate-test-venvs")


def _versions(extra: tuple[str, ...]) -> dict[str, str]:
    found = {}
    for name in (*DEPENDENCIES, *extra):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def shared_python(extra: tuple[str, ...] = ()) -> str:
    """The interpreter of a venv every user can run, with orchestrate's dependencies and
    ``extra`` ones (made once, then reused); skips the test when none can be made."""
    if not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"no {SYSTEM_PYTHON} to make an interpreter every user can run")
    versions = _versions(extra)
    key = uuid.uuid5(uuid.NAMESPACE_URL, json.dumps(sorted(versions.items()))).hex[:10]
    venv = VENVS / key
    python = venv / "bin" / "python3"
    if (venv / "ready").exists():
        return str(python)
    VENVS.mkdir(mode=0o755, parents=True, exist_ok=True)
    building = VENVS / f"{key}.{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(building)], check=True)
    _fill(building, versions)
    probe = subprocess.run([str(building / "bin" / "python3"), "-c",
                            "import yaml, pydantic, jinja2, click, rich" +
                            (", fabric, paramiko" if "fabric" in extra else "")],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        shutil.rmtree(building, ignore_errors=True)
        pytest.skip(f"no shared interpreter: {probe.stderr.strip()[-300:]}")
    (building / "ready").write_text(json.dumps(versions))
    with contextlib.suppress(OSError):
        building.rename(venv)  # another session may have made it meanwhile: either is fine
    shutil.rmtree(building, ignore_errors=True)
    return str(python)


def _fill(venv: Path, versions: dict[str, str]) -> None:
    site = next(venv.glob("lib/python3*/site-packages"))
    same = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                          capture_output=True, text=True).stdout.strip()
    if same == str(tuple(sys.version_info[:2])):
        for name in versions:
            dist = metadata.distribution(name)
            for file in dist.files or []:
                source = Path(str(dist.locate_file(file)))
                if file.parts[0] == ".." or not source.is_file():
                    continue
                target = site / file
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
        return
    subprocess.run([str(venv / "bin" / "python3"), "-m", "ensurepip", "-q"], check=True)
    subprocess.run([str(venv / "bin" / "python3"), "-m", "pip", "install", "-q",
                    *[f"{n}=={v}" for n, v in versions.items()]], check=True)


@dataclass
class User:
    """One Unix user made for a test, running the CLI under its own uid."""

    name: str
    uid: int
    home: Path
    python: str
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 60,
            check: bool = False) -> subprocess.CompletedProcess[str]:
        """``orchestrate ARGS`` as this user."""
        return self.sh([self.python, "-m", "orchestrate", *args], timeout=timeout, check=check)

    def sh(self, argv: list[str], timeout: float = 60,
           check: bool = False) -> subprocess.CompletedProcess[str]:
        """Any command as this user, with its environment only."""
        env = [f"{k}={v}" for k, v in self.env.items()]
        proc = subprocess.run(
            ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--init-groups", "--",
             "env", "-i", *env, *argv],
            cwd=self.home, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{self.name}: {argv} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def status(self, job: str) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.run("status", job, "--json", check=True).stdout)
        return result

    def until(self, job: str, state: str, timeout: float = 30) -> dict[str, Any]:
        """The job's status once it is ``state`` (RUNNING: every rank started)."""
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if self.run("status", job).returncode == 0:
                status = self.status(job)
                if status["state"] == state and (state != "RUNNING" or all(
                        r["pid"] for r in status["ranks"])):
                    return status
            time.sleep(0.2)
        raise AssertionError(f"{self.name}'s job {job} never {state}: {status}")


def processes_of(uid: int) -> list[int]:
    """The pids of every process running as ``uid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
    return found


@contextlib.contextmanager
def unix_users(folder: Path, names: list[str], env: dict[str, str],
               extra: tuple[str, ...] = ()) -> Iterator[list[User]]:
    """Users ``names`` (made now, removed after with everything they still run), each with a
    home under ``folder`` and ``env`` plus their own orchestrate state and run folders; their
    interpreter has ``extra`` packages too."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("making Unix users needs root and useradd")
    python = shared_python(extra)
    made: list[User] = []
    try:
        for name in names:
            home = folder / name
            subprocess.run(["useradd", "--password", "*", "--no-create-home", "--home-dir",
                            str(home), "--user-group", "--shell", "/bin/sh", name],
                           check=True, capture_output=True)
            info = pwd.getpwnam(name)
            home.mkdir(mode=0o755)
            os.chown(home, info.pw_uid, info.pw_gid)
            user = User(name, info.pw_uid, home, python)
            user.env = {**env, "HOME": str(home), "USER": name, "LOGNAME": name,
                        "PYTHONPATH": str(CHECKOUT), "ORCHESTRATE_HOME": str(home / "state"),
                        "ORCHESTRATE_RUNS": str(home / "runs")}
            made.append(user)
        yield made
    finally:
        for user in made:
            _remove(user)


def _remove(user: User) -> None:
    for _ in range(3):
        pids = processes_of(user.uid)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)
    subprocess.run(["userdel", user.name], capture_output=True)
    with contextlib.suppress(KeyError):
        subprocess.run(["groupdel", grp.getgrnam(user.name).gr_name], capture_output=True)
