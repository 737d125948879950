"""A labmate cannot make another user's SSH job run his code (issue #32, class 1): two real
Unix users who log in to h1 as themselves, their runs in a group project folder.

In a ``2775 root:lab`` folder ben may rename ann's ``runs/`` and plant his own run dir with his
``launch-h1.sh``: ann's submit is refused (exit 2) naming the folder, its owner and mode, and
the fix, and his script never runs, on the controller or on h1 (whose agent checks the same
path again before it writes and before it starts a rank: tests/backends/local/
test_local_places.py runs the agent's program as a user for that). In a sticky folder
(``3775``) ben, logged in to h1, cannot rename what is ann's, and her job runs her script.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fakesmi import fake_nvidia_smi
from tests.support.labserver import GPU_INVENTORY_NODE, LAB
from tests.support.sshhosts import SshHosts
from tests.support.unixusers import SSH_DEPENDENCIES, User, unix_users

pytestmark = pytest.mark.ssh


@pytest.fixture
def lab(ssh_hosts: SshHosts) -> Iterator[tuple[User, User, Path, Path]]:
    """ann and ben, members of one group, who can log in to h1; their project folder
    (``2775 root:lab``) and the inventory they share."""
    tag = uuid.uuid4().hex[:5]
    folder = Path(f"/var/tmp/orchestrate-sshplaces-{tag}")
    folder.mkdir(mode=0o755)
    group = f"lab{tag}"
    try:
        (folder / "book").mkdir()
        (folder / "book").chmod(0o1777)
        bin_dir = fake_nvidia_smi(folder / "bin", LAB)
        with unix_users(folder, [f"qa{tag}", f"qb{tag}"],
                        {"PATH": "/usr/local/bin:/usr/bin:/bin"}, SSH_DEPENDENCIES) as made:
            subprocess.run(["groupadd", group], check=True, capture_output=True)
            wrapper = bin_dir / "python"
            wrapper.write_text(f'#!/bin/sh\nPATH={bin_dir}:$PATH exec {made[0].python} "$@"\n')
            wrapper.chmod(0o755)
            project = folder / "project"
            project.mkdir()
            shutil.chown(project, "root", group)
            project.chmod(0o2775)
            for user in made:
                subprocess.run(["usermod", "-aG", group, user.name], check=True,
                               capture_output=True)
                _give_key(user, ssh_hosts.key)
                user.env["ORCHESTRATE_RUNS"] = str(project / "runs" / user.name)
            inventory = folder / "inv.yaml"
            inventory.write_text(json.dumps({
                "name": "shared-host",
                "defaults": {"python": str(wrapper), "ssh": {
                    "identity_file": "~/.ssh/id_ed25519",
                    "known_hosts_file": str(ssh_hosts.known_hosts)}},
                "nodes": [{**GPU_INVENTORY_NODE, "address": dict(ssh_hosts.hosts)["h1"],
                           "lease_dir": str(folder / "book")}],
            }, indent=2) + "\n")
            inventory.chmod(0o644)
            yield made[0], made[1], project, inventory
    finally:
        subprocess.run(["groupdel", group], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def _give_key(user: User, key: Path) -> None:
    ssh = user.home / ".ssh"
    ssh.mkdir(mode=0o700)
    shutil.copyfile(key, ssh / "id_ed25519")
    (ssh / "id_ed25519").chmod(0o600)
    for path in (ssh, ssh / "id_ed25519"):
        os.chown(path, user.uid, user.uid)


def _job(user: User, inventory: Path, name: str, command: str) -> str:
    path = user.home / f"{name}.yaml"
    path.write_text(f"name: {name}\nbackend: ssh\ninventory: {inventory}\n"
                    "resources: {nodes: 1, gpus_per_node: 1, gpu_model: RTX-A6000}\n"
                    "distributed: {master_port: auto}\n"
                    f"command: [bash, -c, {json.dumps(command)}]\n")
    path.chmod(0o644)
    return str(path)


def _on_h1(user: User, hosts: SshHosts, command: str) -> subprocess.CompletedProcess[str]:
    """``command`` on h1, logged in as ``user``."""
    return user.sh(["ssh", "-F", "/dev/null", "-i", f"{user.home}/.ssh/id_ed25519",
                    "-o", f"UserKnownHostsFile={hosts.known_hosts}",
                    "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
                    "-o", "IdentitiesOnly=yes", f"{user.name}@h1",
                    f"test $(id -un) = {user.name} && {command}"], timeout=30)


@pytest.mark.timeout(180)
def test_an_ssh_job_in_a_group_project_folder_is_refused_and_the_plant_never_runs(
        lab: tuple[User, User, Path, Path], ssh_hosts: SshHosts) -> None:
    ann, ben, project, inventory = lab
    runs = project / "runs"
    ann.sh(["mkdir", "-p", str(runs / ann.name)], check=True)
    job = f"j-{ann.name}"
    moved = _on_h1(ben, ssh_hosts, f"mv {runs} {project}/ann-was-here")
    assert moved.returncode == 0, moved.stderr  # the folder above lets any member do it
    marker = project / "planted-ran"
    planted = runs / ann.name / job
    _on_h1(ben, ssh_hosts, f"mkdir -p {planted} && echo 'touch {marker}' > "
           f"{planted}/launch-h1.sh && chmod -R a+rwx {planted}")
    done = ann.run("submit", _job(ann, inventory, "j", "echo mine"), "--job-id", job,
                   timeout=120)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"{project} (owner root:" in said and "mode 2775) is writable by group" in said
    assert f"chmod +t {project}" in said, said
    assert not marker.exists()


@pytest.mark.timeout(180)
def test_in_a_sticky_project_folder_the_ssh_job_runs_its_own_script(
        lab: tuple[User, User, Path, Path], ssh_hosts: SshHosts) -> None:
    ann, ben, project, inventory = lab
    project.chmod(0o3775)
    job = f"s-{ann.name}"
    out = ann.home / "out.txt"
    ann.run("submit", _job(ann, inventory, "s", f"sleep 3; echo mine > {out}"), "--detach",
            "--job-id", job, check=True)
    ann.until(job, "RUNNING")
    tried = _on_h1(ben, ssh_hosts, f"mv {project}/runs {project}/ann-was-here")
    assert tried.returncode != 0 and "not permitted" in tried.stderr, tried.stderr
    status = ann.until(job, "COMPLETED", timeout=60)
    assert status["state"] == "COMPLETED" and out.read_text() == "mine\n"
