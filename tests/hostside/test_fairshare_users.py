"""Fair share between real Unix users made by the test (tests/support/unixusers.py): a heavy
user with ten waiting jobs and a day's use, a light user with one, a third who only looks.
Each runs the lease book's code under its own uid against root's book, as its supervisor
would; root folds the machine's use into its ledger as its crontab line does."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.unixusers import CHECKOUT, User, unix_users

pytestmark = pytest.mark.process

#: What each user's python runs first: the book at argv[1], answers printed as JSON.
PRELUDE = """
import glob, json, os, subprocess, sys, time
from orchestrate.hostside import leases
from orchestrate.hostside.leaserecord import Ticket
ROOT = sys.argv[1]
HOST = os.path.join(ROOT, os.uname()[1])
def out(value): print(json.dumps(value))
def sleeper():  # a process of this user that outlives this program: a ticket's holder
    return subprocess.Popen(["sleep", "300"], start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
def ticket(job, submitted, pid):
    return Ticket(job_id=job, uid=os.geteuid(), submitted_at=submitted, gpus=[0, 1, 2, 3],
                  holders=[(pid, None)])
def claim(job, submitted, pid):
    lease = leases.new_lease(job, "h", [0, 1, 2, 3], 0, None, [pid])
    got = leases.LeaseBook(ROOT).claim(lease, ticket=ticket(job, submitted, pid))
    return [got["ok"], got.get("queue", [])]
"""

HEAVY = """
b = leases.LeaseBook(ROOT)
lease = leases.new_lease("h-yesterday", "h", [0, 1, 2, 3], 0, None, [os.getpid()])
lease.since = time.time() - 6 * 3600  # four GPUs for the last six hours
with b.locked():
    b.record(lease)
b.leave("h-yesterday", [os.getpid()])
pid, now = sleeper(), time.time()
with b.locked():
    for n in range(10):
        b.enqueue(ticket(f"h{n}", now - 600 + n, pid))
out([pid, now - 600])
"""


@pytest.fixture
def lab() -> Iterator[tuple[Path, list[User]]]:
    tag = uuid.uuid4().hex[:5]
    folder = Path(f"/var/tmp/orchestrate-fair-{tag}")
    folder.mkdir(mode=0o755)
    try:
        (folder / "tmp").mkdir()
        (folder / "tmp").chmod(0o1777)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin",
               "ORCHESTRATE_LEASES": str(folder / "tmp" / "leases"),
               "ORCHESTRATE_QUEUE_SLACK_S": "1"}
        with unix_users(folder, [f"fh{tag}", f"fl{tag}", f"fo{tag}"], env) as made:
            yield folder, made
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _py(user: User, code: str, root: Path) -> Any:
    done = user.sh([user.python, "-c", PRELUDE + code, str(root)])
    assert done.returncode == 0, f"{user.name}: {done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_light_users_job_runs_next_and_the_heavy_user_cannot_edit_his_way_ahead(
        lab: tuple[Path, list[User]]) -> None:
    folder, (heavy, light, other) = lab
    root = folder / "tmp" / "leases"
    host = root / socket.gethostname()
    subprocess.run(["install", "-d", "-o", "root", "-g", "root", "-m", "1777", str(root),
                    str(host)], check=True)
    (root / "policy.json").write_text(json.dumps({"half_life_s": 86400, "order": "fair"}))
    heavy_pid, heavy_at = _py(heavy, HEAVY, root)
    light_pid = _py(light, "pid = sleeper()\nb = leases.LeaseBook(ROOT)\nwith b.locked():\n"
                    "    b.enqueue(ticket('l1', time.time(), pid))\nout(pid)", root)
    # The GPUs are free: the heavy user's oldest job is refused, naming the light user's.
    ok, queue = _py(heavy, f"out(claim('h0', {heavy_at!r}, {heavy_pid}))", root)
    assert not ok and any(f"job l1 ({light.name}" in line for line in queue), queue
    # What anyone sees: the light user's one job first, the heavy user's use and share.
    shown = other.run("queue", "--json")
    assert shown.returncode == 0, shown.stderr
    answer = json.loads(shown.stdout)
    assert [w["job_id"] for w in answer["waiting"]][:2] == ["l1", "h0"]
    assert answer["waiting"][1]["why"].startswith("behind 1 job(s)")
    users = {u["user"]: u for u in answer["users"]}
    assert users[heavy.name]["use_gpu_hours"] > 20 and users[heavy.name]["waiting"] == 10
    assert answer["policy"]["source"] == str(root / "policy.json")
    # Root's crontab line keeps the use; then the heavy user hides his record and back-dates
    # his ticket files: his supervisor's next try still waits behind the light user.
    fold = subprocess.run([sys.executable, "-m", "orchestrate", "queue", "--account"],
                          env={**os.environ, "ORCHESTRATE_LEASES": str(root),
                               "PYTHONPATH": str(CHECKOUT)}, capture_output=True, text=True)
    assert fold.returncode == 0, fold.stderr
    edit = ("for path in glob.glob(os.path.join(HOST, '*.used')):\n    os.unlink(path)\n"
            "for path in glob.glob(os.path.join(HOST, f'*@{os.geteuid()}.ticket')):\n"
            "    t = json.load(open(path)); t['submitted_at'] = 1.0\n"
            "    open(path, 'w').write(json.dumps(t))\n"
            f"out(claim('h0', {heavy_at!r}, {heavy_pid}))")
    ok, queue = _py(heavy, edit, root)
    assert not ok and any(f"job l1 ({light.name}" in line for line in queue), queue
    assert not list(host.glob("*.used"))
    # The light user's job takes the GPUs.
    ok, queue = _py(light, f"out(claim('l1', time.time() - 5, {light_pid}))", root)
    assert ok, queue
