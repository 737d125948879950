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
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fakesmi import fake_nvidia_smi, set_compute_apps
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
                        {"PATH": "/usr/local/bin:/usr/bin:/bin",
                         "ORCHESTRATE_FOREIGN_POLL_S": "0.5"}, SSH_DEPENDENCIES) as made:
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


def _on_h1(user: User, ssh_hosts: SshHosts, command: str, timeout: float = 30
           ) -> subprocess.CompletedProcess[str]:
    """``command`` run on h1 by ``user``, logged in as himself with his own key."""
    return user.sh(["ssh", "-F", "/dev/null", "-i", f"{user.home}/.ssh/id_ed25519",
                    "-o", f"UserKnownHostsFile={ssh_hosts.known_hosts}",
                    "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
                    "-o", "IdentitiesOnly=yes", f"{user.name}@h1",
                    f"test $(id -un) = {user.name} && {command}"], timeout=timeout)


def _job(user: User, inventory: Path, name: str,
         until: str = "sleep 600") -> str:
    path = user.home / f"{name}.yaml"
    path.write_text(f"name: {name}\nbackend: ssh\ninventory: {inventory}\n"
                    "resources: {nodes: 1, gpus_per_node: 2, gpu_model: RTX-A6000}\n"
                    "distributed: {master_port: auto}\n"
                    f"command: [bash, -c, 'echo $CUDA_VISIBLE_DEVICES; {until}']\n")
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
        tried = _on_h1(ben, ssh_hosts, command)
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


def _nothing_left(users: list[User], book: Path) -> None:
    """No process of either user runs (here or on h1) and h1's book has no lease left."""
    deadline = time.monotonic() + 10  # the agents on h1 leave within moments of their job
    while (left := [p for u in users for p in processes_of(u.uid)]) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the test users still run (here or on h1): {left}"
    assert not [p.name for p in book.glob("*.json") if p.stat().st_uid == users[0].uid]


@pytest.mark.timeout(180)
def test_another_users_process_on_an_ssh_jobs_gpu_is_named_while_it_runs_and_at_its_end(
        users: tuple[list[User], Path], ssh_hosts: SshHosts) -> None:
    """Issue #32, class 4 over SSH: ben, logged in to h1, runs a process on a GPU ann's job
    leases there. Her job's agent on h1 sees it while the job runs: `status` and the job's
    log name the process, whose it is and its memory; the job then ends COMPLETED saying
    that its GPUs were shared, not quietly."""
    (ann, ben), inventory = users
    job = f"f-{ann.name}"
    done = ann.home / "done"
    ann.run("submit", _job(ann, inventory, "f", f"until test -e {done}; do sleep 0.2; done"),
            "--detach", "--job-id", job, check=True)
    status = ann.until(job, "RUNNING")
    gpu = min(int(g) for g in _placed(status)[0])
    started = _on_h1(ben, ssh_hosts, "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!")
    assert started.returncode == 0, started.stderr
    pid = int(started.stdout.split()[-1])
    try:
        bin_dir = Path(json.loads(inventory.read_text())["defaults"]["python"]).parent
        set_compute_apps(bin_dir, [(pid, "python", gpu, 12288)])
        told = (f"on h1: GPU {gpu} of your job is also used by pid {pid} ({ben.name}, "
                "sleep 300, 12.0 GB)")
        deadline = time.monotonic() + 30  # the agent looks every 0.5 s in this test
        while ann.status(job)["foreign_gpu_use"] != [told] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ann.status(job)["foreign_gpu_use"] == [told]
        assert told in " ".join(ann.run("status", job, check=True).stdout.split())
        run_dir = Path(str(status["run_dir"]))
        assert told in (run_dir / "supervisor.log").read_text()
        done.touch()
        ended = ann.until(job, "COMPLETED")
        assert f"GPU {gpu} of your job was also used by pid {pid} ({ben.name}, " \
            in str(ended["reason"]), ended
    finally:
        set_compute_apps(Path(json.loads(inventory.read_text())["defaults"]["python"]).parent,
                         [])
        _on_h1(ben, ssh_hosts, f"kill {pid}")  # h1's pid: its own process table
    _nothing_left([ann, ben], Path(json.loads(inventory.read_text())["nodes"][0]["lease_dir"])
                  / "h1")


@pytest.mark.timeout(180)
def test_a_labmates_squat_forged_ticket_and_lock_on_an_ssh_host_hold_nobody_back(
        users: tuple[list[User], Path], ssh_hosts: SshHosts) -> None:
    """Issue #32, classes 3 and 4 over SSH (h1's agent runs the same book code as a local
    job): before ann submits, ben, logged in to h1, takes the name of her lease, makes the
    old ``.lock`` file first with mode 0600, and forges a ticket for every GPU at the head of
    the queue with pid 1 as its holder. Her job still starts (not exit 75, no internal error),
    her lease is hers under a second name, and her job's log names each of ben's files."""
    (ann, ben), inventory = users
    job = f"s-{ann.name}"
    book = Path(json.loads(inventory.read_text())["nodes"][0]["lease_dir"]) / "h1"
    forged = json.dumps({"job_id": "f1", "uid": ben.uid, "submitted_at": 1.0,
                         "gpus": list(range(8)), "holders": [[1, None]]})
    planted = _on_h1(ben, ssh_hosts, f"cd {book} && touch {job}@{ann.uid}.json && "
                     f"(umask 077 && touch .lock) && echo '{forged}' > f1@{ben.uid}.ticket")
    assert planted.returncode == 0, planted.stderr
    submitted = ann.run("submit", _job(ann, inventory, "s"), "--detach", "--job-id", job)
    assert submitted.returncode == 0, submitted.stderr
    status = ann.until(job, "RUNNING")
    [lease] = book.glob(f"{job}@{ann.uid}.*.json")  # a second, unguessable name
    assert lease.stat().st_uid == ann.uid and json.loads(lease.read_text())["job_id"] == job
    said = " ".join((Path(str(status["run_dir"])) / "supervisor.log").read_text().split())
    assert f"lease book: {book}/{job}@{ann.uid}.json was taken first by {ben.name}" in said
    assert f"f1@{ben.uid}.ticket of {ben.name} names pid 1 (root" in said
    assert f".lock (Permission denied, owner {ben.name}) is skipped" in said
    listed = ann.run("gpus", "--json", "--inventory", str(inventory))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    [h1] = json.loads(listed.stdout)
    assert any(f"belongs to {ben.name} but is named for uid {ann.uid}" in p
               for p in h1["problems"]), h1["problems"]
    ann.run("cancel", job, check=True)
    _nothing_left([ann, ben], book)
