"""Programs that start their own workers, on the SSH test hosts (issue #21), and commands found
in the inventory's Python environment (a ``bash -c`` command too, whatever ``~/.bashrc`` puts on
PATH: issue #33).

Two hosts (h1, h2), one process per host: the field notes' ``mp.spawn`` program under
``launcher: per_node`` (2 workers per host), an unchanged torchrun script under ``launcher:
torchrun``, and the notes' program unchanged in a ``ranks`` job (1 rank per host, each building
a localhost world of its own: two separate models), which the world check must stop. The
programs are tests/backends/programs/; each worker writes its process group's rank and world.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.output import merged_text
from tests.support.sshcli import SshCli
from tests.support.sshhosts import SshHosts
from tests.support.unixusers import SSH_DEPENDENCIES, User, unix_users

pytestmark = [pytest.mark.ssh, pytest.mark.torch]

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"


def _job(cli: SshCli, name: str, launcher: str, program: str, gpus: int, env: str = "",
         command: str = "") -> tuple[Path, Path]:
    cli.inventory([{"name": "h1", "slots": 2}, {"name": "h2", "slots": 2}])
    out = cli.work / f"out-{name}"
    path = cli.write(f"{name}.yaml", f"""
        name: {name}
        backend: ssh
        inventory: inv.yaml
        launcher: {launcher}
        resources: {{nodes: 2, gpus_per_node: {gpus}}}
        distributed: {{backend: gloo}}
        restart: {{max: 0}}
        env: {{OUT: '{out}'{env}}}
        command: {command or f"[python3, '{PROGRAMS / program}']"}
        """)
    return path, out


def _worlds(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}


def _submit_and_wait(cli: SshCli, path: Path, job: str, timeout: float = 150
                     ) -> dict[str, Any]:
    cli.run("submit", str(path), "--detach", "--job-id", job, check=True, timeout=120)
    return cli.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"}, timeout)


@pytest.mark.timeout(240)
def test_the_field_notes_spawn_program_on_two_hosts_joins_the_plans_world(
        ssh_cli: SshCli) -> None:
    path, out = _job(ssh_cli, "spawn", "per_node", "spawn_train.py", gpus=2)
    status = _submit_and_wait(ssh_cli, path, f"spawn-{os.getpid()}")
    assert status["state"] == "COMPLETED", status
    worlds = _worlds(out)
    assert sorted(worlds) == [0, 1, 2, 3], worlds
    assert {w["world_size"] for w in worlds.values()} == {4}
    assert {r: w["host"] for r, w in worlds.items()} == {0: "h1", 1: "h1", 2: "h2", 3: "h2"}
    assert len({w["weights"] for w in worlds.values()}) == 1  # one model, trained together


@pytest.mark.timeout(240)
def test_an_unchanged_torchrun_script_on_two_hosts(ssh_cli: SshCli) -> None:
    path, out = _job(ssh_cli, "trun", "torchrun", "torchrun_train.py", gpus=2)
    status = _submit_and_wait(ssh_cli, path, f"trun-{os.getpid()}")
    assert status["state"] == "COMPLETED", status
    worlds = _worlds(out)
    assert sorted(worlds) == [0, 1, 2, 3], worlds
    assert {w["world_size"] for w in worlds.values()} == {4}
    assert {r: w["host"] for r, w in worlds.items()} == {0: "h1", 1: "h1", 2: "h2", 3: "h2"}
    assert len({w["weights"] for w in worlds.values()}) == 1


@pytest.mark.timeout(240)
def test_the_notes_program_unchanged_on_two_hosts_is_never_completed(ssh_cli: SshCli) -> None:
    """The issue's case: 2 hosts x 1 rank, each rank's mp.spawn builds a localhost world of 1 and
    trains its own model. Without the world check this ended COMPLETED."""
    path, out = _job(ssh_cli, "own", "ranks", "spawn_train.py", gpus=1,
                     env=", SPAWN_MODE: notes, STEPS: 600, PAUSE_S: 0.1")
    status = _submit_and_wait(ssh_cli, path, f"own-{os.getpid()}")
    assert status["state"] == "FAILED", status
    diagnosis = status["diagnosis"]
    assert diagnosis["kind"] == "wrong_world", diagnosis
    assert "joined a world of 1, the plan has 2" in diagnosis["summary"], diagnosis
    assert diagnosis["nodes"][0] in ("h1", "h2")
    assert status["reason"].startswith(f"wrong world: {diagnosis['summary']}")
    assert _worlds(out) == {}


@pytest.mark.timeout(240)
def test_commands_resolve_in_the_inventorys_python_environment(ssh_cli: SshCli,
                                                              tmp_path: Path) -> None:
    """A Python environment's own executable (here `envtool`, beside the inventory's python) is
    found on the hosts although their login PATH lacks that folder; a missing one is named
    with the folder and the host."""
    env_bin = tmp_path / "env" / "bin"
    env_bin.mkdir(parents=True)
    (env_bin / "python3").symlink_to(sys.executable)
    tool = env_bin / "envtool"
    tool.write_text('#!/bin/sh\n'
                    'echo "envtool on $(hostname) rank $RANK" > "$OUT/rank-$RANK.txt"\n')
    tool.chmod(0o755)
    out = ssh_cli.work / "out-tool"
    out.mkdir()
    ssh_cli.inventory([{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1}],
                      python=str(env_bin / "python3"))
    found = ssh_cli.write("tool.yaml", f"""
        name: tool
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 2, gpus_per_node: 1}}
        env: {{OUT: '{out}'}}
        command: [envtool]
        """)
    status = _submit_and_wait(ssh_cli, found, f"tool-{os.getpid()}")
    assert status["state"] == "COMPLETED", status
    assert sorted(p.read_text().strip() for p in out.glob("*.txt")) == [
        "envtool on h1 rank 0", "envtool on h2 rank 1"]
    missing = ssh_cli.write("missing.yaml", """
        name: missing
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 2, gpus_per_node: 1}
        command: [no-such-envtool, --help]
        """)
    status = _submit_and_wait(ssh_cli, missing, f"missing-{os.getpid()}")
    assert status["state"] == "FAILED", status
    log = merged_text(Path(status["run_dir"]))
    assert f"orchestrate: no-such-envtool: not in {env_bin} or on PATH on h" in log, log


def _started(out: Path, count: int, timeout: float = 120) -> dict[int, tuple[str, int]]:
    """Every worker's (host, pid on that host), once all of them joined."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {int(p.stem.split("-")[1]): p.read_text().split() for p in
                 out.glob("started-*.txt")}
        if len(found) == count and all(len(v) == 2 for v in found.values()):
            return {rank: (v[0], int(v[1])) for rank, v in found.items()}
        time.sleep(0.3)
    raise AssertionError(f"the workers never all joined: {sorted(out.glob('*'))}")


@pytest.mark.timeout(240)
def test_a_killed_worker_on_h2_fails_the_job_naming_it(ssh_cli: SshCli) -> None:
    import signal

    job = f"wkill-{os.getpid()}"
    path, out = _job(ssh_cli, "wkill", "per_node", "spawn_train.py", gpus=2,
                     env=", STEPS: 900, PAUSE_S: 0.1")
    ssh_cli.run("submit", str(path), "--detach", "--job-id", job, check=True, timeout=120)
    started = _started(out, 4)
    host, pid = started[3]
    assert host == "h2"
    os.kill(ssh_cli.hosts.root_pid("h2", pid), signal.SIGKILL)
    status = ssh_cli.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"}, 90)
    assert status["state"] == "FAILED", status
    assert status["reason"].startswith("rank 3 on h2 failed with signal 9"), status["reason"]


@pytest.mark.timeout(240)
def test_cancel_leaves_no_worker_on_any_host(ssh_cli: SshCli) -> None:
    import time

    from tests.support.sshhosts import tagged_by_namespace

    job = f"wcxl-{os.getpid()}"
    path, out = _job(ssh_cli, "wcxl", "per_node", "spawn_train.py", gpus=2,
                     env=", STEPS: 900, PAUSE_S: 0.1")
    ssh_cli.run("submit", str(path), "--detach", "--job-id", job, check=True, timeout=120)
    _started(out, 4)
    assert set(tagged_by_namespace(ssh_cli.hosts, job)) == {"h1", "h2"}
    ssh_cli.run("cancel", job, check=True)
    status = ssh_cli.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"}, 60)
    assert status["state"] == "CANCELLED", status
    deadline = time.monotonic() + 15
    while tagged_by_namespace(ssh_cli.hosts, job) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert tagged_by_namespace(ssh_cli.hosts, job) == {}


def _owned(user: User, path: Path, text: str, mode: int) -> None:
    path.write_text(text)
    path.chmod(mode)
    os.chown(path, user.uid, user.uid)


@pytest.mark.timeout(240)
def test_bash_c_over_ssh_sees_the_inventorys_python_whatever_bashrc_says(
        ssh_hosts: SshHosts) -> None:
    """A user whose ~/.bashrc puts a bad python first on PATH: bash reads it for a command that
    sshd seems to start (SSH_CLIENT set, stdin a socket, level below 2). The rank's
    ``bash -c 'python ...'`` still runs the inventory's python on h1."""
    tag = uuid.uuid4().hex[:5]
    folder = Path(f"/var/tmp/orchestrate-bashrc-{tag}")
    folder.mkdir(mode=0o755)
    try:
        with unix_users(folder, [f"rc{tag}"], {"PATH": "/usr/local/bin:/usr/bin:/bin"},
                        SSH_DEPENDENCIES) as [user]:
            env_bin = folder / "env" / "bin"
            env_bin.mkdir(parents=True)
            wrapper = env_bin / "python"
            wrapper.write_text(f'#!/bin/sh\nexec {user.python} "$@"\n')
            wrapper.chmod(0o755)
            bad = user.home / "bad"
            bad.mkdir()
            os.chown(bad, user.uid, user.uid)
            _owned(user, bad / "python", "#!/bin/sh\necho bad python >&2\nexit 3\n", 0o755)
            _owned(user, user.home / ".bashrc", f'export PATH="{bad}:$PATH"\n', 0o644)
            ssh = user.home / ".ssh"
            ssh.mkdir(mode=0o700)
            os.chown(ssh, user.uid, user.uid)
            _owned(user, ssh / "id_ed25519", ssh_hosts.key.read_text(), 0o600)
            out = user.home / "out"
            out.mkdir()
            os.chown(out, user.uid, user.uid)
            _owned(user, user.home / "inv.yaml", json.dumps({
                "name": "bashrc-host",
                "defaults": {"python": str(wrapper), "ssh": {
                    "identity_file": "~/.ssh/id_ed25519",
                    "known_hosts_file": str(ssh_hosts.known_hosts)}},
                "nodes": [{"name": "h1", "address": dict(ssh_hosts.hosts)["h1"], "slots": 1}],
            }) + "\n", 0o644)
            _owned(user, user.home / "job.yaml", (
                f"name: bashc\nbackend: ssh\ninventory: {user.home / 'inv.yaml'}\n"
                "resources: {nodes: 1, gpus_per_node: 1}\n"
                f"env: {{OUT: '{out}'}}\n"
                "command: [bash, -c, 'command -v python > \"$OUT/found.txt\"; python -c pass']\n"),
                0o644)
            job = f"bashc-{tag}"
            user.run("submit", str(user.home / "job.yaml"), "--detach", "--job-id", job,
                     check=True, timeout=120)
            deadline = time.monotonic() + 150
            status = user.status(job)
            while status["state"] in ("PENDING", "RUNNING") and time.monotonic() < deadline:
                time.sleep(0.5)
                status = user.status(job)
            assert status["state"] == "COMPLETED", status
            assert (out / "found.txt").read_text().strip() == str(wrapper)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
