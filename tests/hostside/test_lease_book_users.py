"""A hostile labmate against the lease book (issue #32, classes 2-4), with real Unix users made
by the test (tests/support/unixusers.py): ann is the victim, ben the labmate with a shell on the
same server. Each test plays one attack as ben, under his own uid, and checks as ann (under
hers) that it fails and what she is told. Two users' jobs end to end are in
tests/backends/local/test_local_users.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakesmi import fake_nvidia_smi, set_compute_apps
from tests.support.labserver import LAB
from tests.support.unixusers import User, unix_users

pytestmark = pytest.mark.process

#: What each user's python runs first: the book at argv[1], answers printed as JSON.
PRELUDE = """
import json, os, subprocess, sys, time
from orchestrate.hostside import leases
from orchestrate.hostside.leaserecord import Ticket
ROOT = sys.argv[1]
def out(value): print(json.dumps(value))
def sleeper():  # a process of this user that outlives this program: a lease's holder
    return subprocess.Popen(["sleep", "300"], start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
"""


@pytest.fixture
def lab() -> Iterator[tuple[Path, list[User]]]:
    tag = uuid.uuid4().hex[:5]
    folder = Path(f"/var/tmp/orchestrate-book-{tag}")
    folder.mkdir(mode=0o755)
    try:
        (folder / "tmp").mkdir()
        (folder / "tmp").chmod(0o1777)  # like /var/tmp, where the default book lives
        bin_dir = fake_nvidia_smi(folder / "bin", LAB)
        env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
               "ORCHESTRATE_LEASES": str(_root(folder)), "ORCHESTRATE_QUEUE_SLACK_S": "1"}
        with unix_users(folder, [f"la{tag}", f"lb{tag}"], env) as made:
            yield folder, made
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _root(folder: Path) -> Path:
    """The test's book, in a ``1777`` folder as the default is in /var/tmp."""
    return folder / "tmp" / "leases"


def _py(user: User, code: str, root: Path) -> Any:
    """Run ``code`` as ``user`` against the book at ``root``; its last line, parsed."""
    done = user.sh([user.python, "-c", PRELUDE + code, str(root)])
    assert done.returncode == 0, f"{user.name}: {done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _root_makes(root: Path) -> Path:
    """What root runs once (docs/shared-servers.md): the book's folders, root's own."""
    host = root / socket.gethostname()
    subprocess.run(["install", "-d", "-o", "root", "-g", "root", "-m", "1777", str(root),
                    str(host)], check=True)
    return host


def test_a_book_another_user_made_is_refused_with_roots_one_line_fix(
        lab: tuple[Path, list[User]]) -> None:
    """Class 2: the folder's owner could delete every other user's lease (sticky or not), so
    ben refuses ann's book (exit 78 from `submit`, never 2), `gpus` says why; root's one line
    fixes it, and then neither can delete the other's lease."""
    folder, (ann, ben) = lab
    root = _root(folder)
    made = _py(ann, "b = leases.LeaseBook(ROOT)\nout(b.trust)", root)
    assert made.startswith(f"made by {ann.name}: other users refuse it")
    refused = _py(ben, "try:\n    leases.LeaseBook(ROOT)\nexcept leases.BookError as e:\n"
                  "    out([str(e), e.hint, e.busy])", root)
    message, hint, busy = refused
    assert f"belongs to {ann.name}" in message and not busy
    assert hint.startswith("as root, once: install -d -o root -g root -m 1777 ")
    listed = ben.run("gpus")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    assert f"unusable: the lease book {root}" in " ".join(listed.stdout.split())
    job = ben.home / "cpu.yaml"
    job.write_text(f"name: cpu\nbackend: local\ncommand: [python3, -c, pass]\n"
                   f"workdir: {ben.home}\n")
    job.chmod(0o644)
    submitted = ben.run("submit", "--detach", str(job))
    assert submitted.returncode == 78, submitted.stderr
    assert f"belongs to {ann.name}" in submitted.stderr and "install -d" in submitted.stderr
    # Root runs the hint's command; the book is root's, both users use it.
    subprocess.run(hint.split(": ", 1)[1], shell=True, check=True)
    code = ("b = leases.LeaseBook(ROOT)\nwith b.locked():\n"
            "    b.record(leases.new_lease('j-' + str(os.geteuid()), 'h', [0], 0, None, "
            "[sleeper()]))\nout(b.trust)")
    assert _py(ben, code, root).startswith("made by root")
    _py(ann, code, root)
    [ann_lease] = root.glob(f"*/j-{ann.uid}@{ann.uid}.json")
    assert ben.sh(["rm", "-f", str(ann_lease)]).returncode != 0 and ann_lease.exists()


def test_a_group_project_folder_above_the_book_is_refused(
        lab: tuple[Path, list[User]]) -> None:
    """Class 2, the folders above: in a ``2775`` project folder any member can rename the book
    away and put their own in its place, so the book below it is refused, naming it."""
    folder, (ann, _) = lab
    project = folder / "project"
    project.mkdir()
    os.chown(project, 0, ann.uid)
    project.chmod(0o2775)
    said = _py(ann, "try:\n    leases.LeaseBook(ROOT)\nexcept leases.BookError as e:\n"
               "    out(str(e))", project / "leases")
    assert f"below {project} (owner root, mode 2775)" in said
    assert not (project / "leases").exists()


def test_bad_files_are_named_with_their_owner_never_an_internal_error(
        lab: tuple[Path, list[User]]) -> None:
    """Class 3: ben's leases with a field of the wrong type are named (owner and path) and
    honoured as holding everything while ben's processes run: ann's claim is refused, naming
    them (busy, not an internal error); `gpus` names them; 1,000 of them make a few lines; a
    lock file made a folder by ben locks nobody out."""
    folder, (ann, ben) = lab
    host = _root_makes(_root(folder))
    plant = ("pid = sleeper()\nfor job, bad in [('g', {'gpus': 5}), ('p', {'port': 'x'}),\n"
             "                 ('s', {'since': 1e300})]:\n"
             "    record = dict({'job_id': job, 'holders': [[pid, None]], 'gpus': [1]}, **bad)\n"
             "    path = os.path.join(ROOT, os.uname()[1], f'{job}@{os.geteuid()}.json')\n"
             "    open(path, 'w').write(json.dumps(record))\n"
             "os.mkdir(os.path.join(ROOT, os.uname()[1], '.lock'))\nout(pid)")
    _py(ben, plant, _root(folder))
    claim = _py(ann, "b = leases.LeaseBook(ROOT)\nout(b.claim(leases.new_lease("
                "'a1', 'h', [0], 0, None, [sleeper()])))", _root(folder))
    assert claim["ok"] is False and len(claim["unknown"]) == 3
    for job, field in (("g", "gpus"), ("p", "port"), ("s", "since")):
        [line] = [u for u in claim["unknown"] if f"/{job}@{ben.uid}.json" in u]
        assert f"of {ben.name} cannot be read (not a valid lease: {field}: " in line
    assert any(f".lock (not a file, owner {ben.name}) is skipped" in p
               for p in claim["problems"])
    listed = ann.run("gpus", "--json")
    assert listed.returncode == 0, listed.stderr
    assert sum(f"of {ben.name} cannot be read" in p
               for p in json.loads(listed.stdout)["problems"]) == 3
    _py(ben, "for i in range(1000):\n    open(os.path.join(ROOT, os.uname()[1], "
            "f'x{i}@{os.geteuid()}.json'), 'w').write('{not json')\nout(0)", _root(folder))
    many = ann.run("gpus")
    assert many.returncode == 0 and "Traceback" not in many.stderr
    assert "more files of" in many.stdout and len(many.stdout) < 8000, len(many.stdout)
    assert len(list(host.glob("*.json"))) == 1003


def test_squatted_names_and_forged_tickets_are_named_and_ignored(
        lab: tuple[Path, list[User]]) -> None:
    """Class 4: ben takes the names of ann's ticket and lease before she writes them (her
    claim still succeeds, under a second name, and ben is named); a ticket ben forges with
    pid 1 as its holder, or with a place before its holder started, does not hold her back;
    class 3: a ``0600`` lock file of ben's locks nobody out (the folder is the lock)."""
    folder, (ann, ben) = lab
    host = _root_makes(_root(folder))
    for kind in (".json", ".ticket"):
        ben.sh(["touch", str(host / f"a1@{ann.uid}{kind}")], check=True)
    # and the lock file older orchestrates use, made first and unreadable to others
    ben.sh(["sh", "-c", f"umask 077 && touch {host / '.lock'}"], check=True)
    ann_ticket = ("pid = sleeper()\nt = Ticket(job_id='a1', uid=os.geteuid(), "
                  "submitted_at=time.time(), gpus=[0], holders=[(pid, None)])\n"
                  "b = leases.LeaseBook(ROOT)\nwith b.locked():\n    b.enqueue(t)\n"
                  "out([pid, time.time()])")
    pid, queued_at = _py(ann, ann_ticket, _root(folder))
    time.sleep(2.5)  # ben forges after her ticket; the queue's slack is 1 s in this test
    forge = ("one = [1, int(open('/proc/1/stat').read().rsplit(')', 1)[1].split()[19])]\n"
             "for job, holder in (('f1', one), ('f2', [sleeper(), None])):\n"
             "    t = {'job_id': job, 'uid': os.geteuid(), 'submitted_at': 1.0, 'gpus': [0],\n"
             "         'holders': [holder]}\n"
             "    open(os.path.join(ROOT, os.uname()[1], f'{job}@{os.geteuid()}.ticket'),"
             " 'w').write(json.dumps(t))\nout(0)")
    _py(ben, forge, _root(folder))
    claim = _py(ann, f"b = leases.LeaseBook(ROOT)\nt = Ticket(job_id='a1', uid=os.geteuid(), "
                f"submitted_at={queued_at}, gpus=[0], holders=[({pid}, None)])\n"
                f"out(b.claim(leases.new_lease('a1', 'h', [0], 0, None, [{pid}]), ticket=t))",
                _root(folder))
    assert claim["ok"] is True, claim
    said = " ".join(claim["problems"])
    assert f"a1@{ann.uid}.json was taken first by {ben.name}" in said
    assert f"f1@{ben.uid}.ticket of {ben.name} names pid 1 (root, " in said
    assert f"f2@{ben.uid}.ticket of {ben.name} claims a place in the queue from" in said
    assert f".lock (Permission denied, owner {ben.name}) is skipped" in said
    [lease] = [p for p in host.glob(f"a1@{ann.uid}.*.json")]
    assert lease.stat().st_uid == ann.uid and json.loads(lease.read_text())["gpus"] == [0]
    seen = _py(ann, "b = leases.LeaseBook(ROOT)\nwith b.locked():\n"
               "    out([[l.job_id, l.user] for l in b.live()] + b.problems)", _root(folder))
    assert ["a1", ann.name] in seen
    assert any(f"a1@{ann.uid}.json belongs to {ben.name} but is named for uid {ann.uid}"
               in str(line) for line in seen)


def test_another_users_process_on_a_leased_gpu_is_named_not_listed_as_the_jobs(
        lab: tuple[Path, list[User]]) -> None:
    """Class 4, foreign use: ben's process on the GPU ann's job leases is not the job's; `gpus`
    says so, and ann is told "GPU 3 of your job is also used by pid N (ben, ...)"."""
    folder, (ann, ben) = lab
    _root_makes(_root(folder))
    ann_pid = _py(ann, "pid = sleeper()\nb = leases.LeaseBook(ROOT)\nwith b.locked():\n"
                  "    b.record(leases.new_lease('a3', 'h', [3], 0, None, [pid]))\nout(pid)",
                  _root(folder))
    ben_pid = _py(ben, "out(sleeper())", _root(folder))
    set_compute_apps(folder / "bin", [(ann_pid, "sleep", 3, 2048),
                                      (ben_pid, "python", 3, 12288)])
    listed = json.loads(ann.run("gpus", "--json", check=True).stdout)
    [gpu] = [g for g in listed["gpus"] if g["index"] == 3]
    by_pid = {h["pid"]: h for h in gpu["holders"] if h["kind"] == "process"}
    assert by_pid[ann_pid]["job_id"] == "a3" and not by_pid[ann_pid]["foreign"]
    assert by_pid[ben_pid]["job_id"] is None and by_pid[ben_pid]["foreign"]
    assert f"GPU 3 of {ann.name}'s job a3 is also used by pid {ben_pid} ({ben.name}, " \
        "sleep 300, 12.0 GB)" in listed["problems"]
    told = _py(ann, "from orchestrate.backends.sharing import foreign_gpu_use\n"
               "out(list(foreign_gpu_use('a3', ROOT).values()))", _root(folder))
    assert told == [f"GPU 3 of your job is also used by pid {ben_pid} ({ben.name}, "
                    "sleep 300, 12.0 GB)"]
