"""Two real Unix users share one SSH host (issue #20): the README's promise that two jobs on
one server never collide, for the SSH backend, whoever submits them.

As root, two users are made (tests/support/unixusers.py, their interpreter with Fabric and
paramiko) and run orchestrate under their own uids; each logs in to h1 *as itself* with its
own copy of the test hosts' key, and h1's agents run under that user's uid against one lease
book (the inventory's ``lease_dir``, folders root made ``1777`` once, as docs/shared-servers.md
says). h1 has the lab server's GPUs (2x A100 + 6x A6000) through the inventory's python,
a wrapper every user can run that puts the stand-in nvidia-smi on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fakesmi import fake_nvidia_smi
from tests.support.labserver import GPU_INVENTORY_NODE, LAB
from tests.support.sshhosts import SshHosts
from tests.support.unixusers import SSH_DEPENDENCIES, User, processes_of, unix_users

pytestmark = pytest.mark.ssh


@pytest.fixture
def users(ssh_hosts: SshHosts) -> Iterator[tuple[list[User], Path]]:
    """Two users who can log in to h1, and the inventory they share."""
    tag = uuid.uuid4().hex[:5]
    folder = Path(f"/var/tmp/orchestrate-sshusers-{tag}")
    folder.mkdir(mode=0o755)
    try:
        for book in (folder / "book", folder / "book" / "h1"):  # root's, made once
            book.mkdir()
            book.chmod(0o1777)
        bin_dir = fake_nvidia_smi(folder / "bin", LAB)
        with unix_users(folder, [f"sa{tag}", f"sb{tag}"],
                        {"PATH": "/usr/local/bin:/usr/bin:/bin"}, SSH_DEPENDENCIES) as made:
            wrapper = bin_dir / "python"
            wrapper.write_text(f'#!/bin/sh\nPATH={bin_dir}:$PATH exec {made[0].python} "$@"\n')
            wrapper.chmod(0o755)
            for user in made:
                _give_key(user, ssh_hosts.key)
            inventory = folder / "inv.yaml"
            inventory.write_text(json.dumps({
                "name": "shared-host",
                "defaults": {"python": str(wrapper), "ssh": {
                    "identity_file": "~/.ssh/id_ed25519",  # each user's own copy
                    "known_hosts_file": str(ssh_hosts.known_hosts)}},
                "nodes": [{**GPU_INVENTORY_NODE, "address": dict(ssh_hosts.hosts)["h1"],
                           "lease_dir": str(folder / "book")}],
            }, indent=2) + "\n")
            inventory.chmod(0o644)
            yield made, inventory
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _give_key(user: User, key: Path) -> None:
    """The test hosts' key, as this user's own ``~/.ssh/id_ed25519`` (sshd takes it for every
    account: the hosts' AuthorizedKeysFile is one file)."""
    ssh = user.home / ".ssh"
    ssh.mkdir(mode=0o700)
    shutil.copyfile(key, ssh / "id_ed25519")
    (ssh / "id_ed25519").chmod(0o600)
    for path in (ssh, ssh / "id_ed25519"):
        os.chown(path, user.uid, user.uid)


def _job(user: User, inventory: Path, name: str) -> str:
    path = user.home / f"{name}.yaml"
    path.write_text(f"name: {name}\nbackend: ssh\ninventory: {inventory}\n"
                    "resources: {nodes: 1, gpus_per_node: 2, gpu_model: RTX-A6000}\n"
                    "distributed: {master_port: auto}\n"
                    "command: [bash, -c, 'echo $CUDA_VISIBLE_DEVICES; sleep 600']\n")
    path.chmod(0o644)
    return str(path)


def _placed(status: dict[str, object]) -> tuple[set[str], int]:
    plan = json.loads((Path(str(status["run_dir"])) / "plan.json").read_text())
    return set(plan["nodes"][0]["cuda_visible_devices"].split(",")), int(plan["master_port"])


@pytest.mark.timeout(180)
def test_two_users_share_an_ssh_host_on_disjoint_gpus_and_ports(
        users: tuple[list[User], Path], ssh_hosts: SshHosts) -> None:
    (ann, ben), inventory = users
    a_job, b_job = f"a-{ann.name}", f"b-{ben.name}"
    ann.run("submit", _job(ann, inventory, "a"), "--detach", "--job-id", a_job, check=True)
    ben.run("submit", _job(ben, inventory, "b"), "--detach", "--job-id", b_job, check=True)
    a_gpus, a_port = _placed(ann.until(a_job, "RUNNING"))
    b_gpus, b_port = _placed(ben.until(b_job, "RUNNING"))
    assert a_gpus.isdisjoint(b_gpus) and len(a_gpus | b_gpus) == 4, (a_gpus, b_gpus)
    assert a_port != b_port
    # On h1 the leases are each user's own files in the one shared, sticky book.
    book = Path(json.loads(inventory.read_text())["nodes"][0]["lease_dir"]) / "h1"
    assert stat.S_IMODE(book.stat().st_mode) == 0o1777
    [a_lease] = book.glob(f"{a_job}@{ann.uid}.json")
    [b_lease] = book.glob(f"{b_job}@{ben.uid}.json")
    assert a_lease.stat().st_uid == ann.uid and b_lease.stat().st_uid == ben.uid
    # Logged in to h1 as himself, ben cannot delete, overwrite or rename ann's lease.
    for command in (f"rm -f {a_lease}", f"echo '{{}}' > {a_lease}",
                    f"mv -f {a_lease} {a_lease}.x"):
        tried = ben.sh(["ssh", "-F", "/dev/null", "-i", f"{ben.home}/.ssh/id_ed25519",
                        "-o", f"UserKnownHostsFile={ssh_hosts.known_hosts}",
                        "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
                        "-o", "IdentitiesOnly=yes", f"{ben.name}@h1",
                        f"test $(id -un) = {ben.name} && {command}"], timeout=30)
        said = tried.stderr  # from rm, sh or mv on h1: sticky folder, ann's 0644 file
        assert tried.returncode != 0 and str(a_lease) in said and (
            "Operation not permitted" in said or "Permission denied" in said), said
    assert json.loads(a_lease.read_text())["job_id"] == a_job
    # `gpus --inventory`, as either user, names both users' jobs on their GPUs of h1.
    [h1] = json.loads(ann.run("gpus", "--json", "--inventory", str(inventory),
                              check=True).stdout)
    holders = {g["index"]: [(h["user"], h["job_id"]) for h in g["holders"]]
               for g in h1["gpus"]}
    for gpu in a_gpus:
        assert holders[int(gpu)] == [(ann.name, a_job)]
    for gpu in b_gpus:
        assert holders[int(gpu)] == [(ben.name, b_job)]
    ann.run("cancel", a_job, check=True)
    ben.run("cancel", b_job, check=True)
    deadline = time.monotonic() + 10  # the agents on h1 leave within moments of their job
    while (left := [p for u in (ann, ben) for p in processes_of(u.uid)]) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the test users still run (here or on h1): {left}"
    left_leases = {p.name: p.read_text() for p in book.glob("*.json")}
    logs = {u.name: (u.home / "runs" / j / "supervisor.log").read_text()
            for u, j in ((ann, a_job), (ben, b_job))}
    assert not left_leases, (left_leases, logs)
