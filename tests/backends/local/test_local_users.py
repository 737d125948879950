"""Two real Unix users share the lab server on the local backend (issue #20): the README's
promise that two jobs on one server never collide, whoever submits them.

As root, two users are made (tests/support/unixusers.py) and run orchestrate under their own
uids with a shared interpreter, against one lease book (``ORCHESTRATE_LEASES``, made by root
once, as docs/shared-servers.md says: a book one user made, the other refuses) and the stand-in
nvidia-smi of the lab server (2x A100 + 6x A6000). One SSH host shared by two users is in
tests/backends/ssh/test_ssh_users.py.
"""

from __future__ import annotations

import json
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fakesmi import fake_nvidia_smi, set_compute_apps
from tests.support.labserver import LAB
from tests.support.unixusers import User, processes_of, unix_users

pytestmark = pytest.mark.process


@pytest.fixture
def users() -> Iterator[list[User]]:
    tag = uuid.uuid4().hex[:5]
    folder = Path(f"/var/tmp/orchestrate-users-{tag}")
    folder.mkdir(mode=0o755)
    try:
        for book in (folder / "book", folder / "book" / socket.gethostname()):
            book.mkdir()
            book.chmod(0o1777)  # root's, as `install -d -o root -m 1777` makes it
        bin_dir = fake_nvidia_smi(folder / "bin", LAB)
        env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
               "ORCHESTRATE_LEASES": str(folder / "book"), "ORCHESTRATE_FOREIGN_POLL_S": "0.5"}
        with unix_users(folder, [f"oa{tag}", f"ob{tag}"], env) as made:
            yield made
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _job(user: User, name: str, gpus: int, model: str, seconds: int = 600,
         until: str | None = None) -> str:
    path = user.home / f"{name}.yaml"
    path.write_text(f"name: {name}\nresources: {{nodes: 1, gpus_per_node: {gpus}, "
                    f"gpu_model: {model}}}\ndistributed: {{master_port: auto}}\n"
                    "command: [bash, -c, 'echo $CUDA_VISIBLE_DEVICES; "
                    f"{until or f'sleep {seconds}'}']\n")
    path.chmod(0o644)
    return str(path)


def _placed(status: dict[str, object]) -> tuple[set[str], int]:
    plan = json.loads((Path(str(status["run_dir"])) / "plan.json").read_text())
    return set(plan["nodes"][0]["cuda_visible_devices"].split(",")), int(plan["master_port"])


@pytest.mark.timeout(240)
def test_two_users_jobs_get_disjoint_gpus_and_ports_and_see_each_other(
        users: list[User]) -> None:
    ann, ben = users
    a_job, b_job = f"a-{ann.name}", f"b-{ben.name}"
    ann.run("submit", _job(ann, "a", 3, "RTX-A6000"), "--detach", "--job-id", a_job,
            check=True)
    ben.run("submit", _job(ben, "b", 3, "RTX-A6000"), "--detach", "--job-id", b_job,
            check=True)
    a_gpus, a_port = _placed(ann.until(a_job, "RUNNING"))
    b_gpus, b_port = _placed(ben.until(b_job, "RUNNING"))
    assert a_gpus.isdisjoint(b_gpus) and a_gpus | b_gpus == {"2", "3", "4", "5", "6", "7"}
    assert a_port != b_port
    # A third job, of either user, is told who holds the GPUs (exit 75: try again later).
    third = ben.run("submit", _job(ben, "c", 1, "RTX-A6000"), "--detach", "--job-id",
                    f"c-{ben.name}")
    assert third.returncode == 75, third.stderr
    said = " ".join(third.stderr.split())
    assert f"job {a_job} ({ann.name}, since" in said and f"job {b_job} ({ben.name}" in said
    # `gpus` (as either user) names both users' jobs on their GPUs.
    listed = json.loads(ben.run("gpus", "--json", check=True).stdout)
    holders = {g["index"]: [(h["user"], h["job_id"]) for h in g["holders"]]
               for g in listed["gpus"]}
    for gpu in a_gpus:
        assert holders[int(gpu)] == [(ann.name, a_job)]
    for gpu in b_gpus:
        assert holders[int(gpu)] == [(ben.name, b_job)]
    # Neither can delete or overwrite the other's lease; the book is shared, sticky.
    book = Path(ann.env["ORCHESTRATE_LEASES"])
    assert stat.S_IMODE(book.stat().st_mode) == 0o1777
    [lease] = [p for p in book.glob(f"*/{a_job}@{ann.uid}.json")]
    assert lease.stat().st_uid == ann.uid and stat.S_IMODE(lease.stat().st_mode) == 0o644
    assert ben.sh(["rm", "-f", str(lease)]).returncode != 0
    assert ben.sh(["sh", "-c", f"echo '{{}}' > {lease}"]).returncode != 0
    assert ben.sh(["mv", "-f", str(lease), str(lease) + ".x"]).returncode != 0
    assert lease.exists() and json.loads(lease.read_text())["job_id"] == a_job
    ann.run("cancel", a_job, check=True)
    ben.run("cancel", b_job, check=True)
    _nothing_left(users)
    assert not list(book.glob("*/*.json"))


@pytest.mark.timeout(240)
def test_waiting_jobs_of_two_users_start_first_come_first_served(users: list[User]) -> None:
    ann, ben = users
    holder, ben_first, ann_later = f"h-{ann.name}", f"w1-{ben.name}", f"w2-{ann.name}"
    ann.run("submit", _job(ann, "h", 2, "A100-80GB"), "--detach", "--job-id", holder,
            check=True)
    ann.until(holder, "RUNNING")
    ben.run("submit", _job(ben, "w1", 2, "A100-80GB"), "--detach", "--job-id", ben_first,
            "--wait", check=True)
    ben.until(ben_first, "PENDING")
    ann.run("submit", _job(ann, "w2", 1, "A100-80GB"), "--detach", "--job-id", ann_later,
            "--wait", check=True)
    waiting = ann.until(ann_later, "PENDING")
    assert f"job {ben_first} ({ben.name}" in str(waiting["reason"])  # queued behind ben
    ann.run("cancel", holder, check=True)
    ben.until(ben_first, "RUNNING", timeout=15)  # ben's, submitted first, not ann's small one
    assert ann.status(ann_later)["state"] == "PENDING"
    ben.run("cancel", ben_first, check=True)
    ann.until(ann_later, "RUNNING", timeout=15)
    ann.run("cancel", ann_later, check=True)
    _nothing_left(users)


@pytest.mark.timeout(240)
def test_another_users_process_on_a_jobs_gpu_is_named_to_the_jobs_owner(
        users: list[User]) -> None:
    """Issue #32, class 4: ben runs a process on the GPU ann's job leases. It is not listed as
    the job's; ann is told, in `status` and in the job's log, which process, whose, and how
    much memory it takes, and the job's COMPLETED ending says its GPU was shared."""
    ann, ben = users
    job = f"f-{ann.name}"
    done = ann.home / "done"
    ann.run("submit", _job(ann, "f", 1, "A100-80GB",
                           until=f"until test -e {done}; do sleep 0.2; done"),
            "--detach", "--job-id", job, check=True)
    status = ann.until(job, "RUNNING")
    [gpu] = _placed(status)[0]
    sleeper = ben.sh(["sh", "-c", "sleep 300 </dev/null >/dev/null 2>&1 & echo $!"], check=True)
    pid = int(sleeper.stdout.strip())
    set_compute_apps(Path(ann.env["PATH"].split(":")[0]), [(pid, "python", int(gpu), 12288)])
    told = f"GPU {gpu} of your job is also used by pid {pid} ({ben.name}, sleep 300, 12.0 GB)"
    deadline = time.monotonic() + 30  # the supervisor looks every 0.5 s in this test
    while ann.status(job)["foreign_gpu_use"] != [told] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ann.status(job)["foreign_gpu_use"] == [told]
    assert told in " ".join(ann.run("status", job, check=True).stdout.split())
    assert told in (Path(str(status["run_dir"])) / "supervisor.log").read_text()
    listed = json.loads(ben.run("gpus", "--json", check=True).stdout)
    [on_gpu] = [h for g in listed["gpus"] if g["index"] == int(gpu) for h in g["holders"]
                if h["pid"] == pid]
    assert on_gpu["foreign"] and on_gpu["job_id"] is None  # not listed as ann's job's
    done.touch()  # the job ends COMPLETED, saying that its GPU was shared
    ended = ann.until(job, "COMPLETED")
    assert told.replace(" is also used ", " was also used ") in str(ended["reason"]), ended
    ben.sh(["kill", str(pid)])
    _nothing_left(users)


def _nothing_left(users: list[User]) -> None:
    """No process of either user runs (the watchdogs leave within moments of their job)."""
    deadline = time.monotonic() + 10
    while (left := [p for u in users for p in processes_of(u.uid)]) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the test users still run: {left}"
