"""A labmate cannot make another user's job run his code (issue #32, class 1), on the local
backend and in the SSH agent's program, with real Unix users.

The usual lab layout: a group project folder ``2775 root:lab`` where both users keep their
runs. A member may rename anything in such a folder, so ben renames ann's ``runs/`` and puts
his own in its place, with the run dir her next job will use and his ``launch-*.sh`` (or
``sitecustomize.py``) in it. orchestrate refuses to write or run there, naming the folder, its
owner and mode and the fix; in a sticky project folder (``3775``) ben cannot rename what is
ann's, and her job runs her own script. The agent (the program every SSH host runs) is run here
as ann, the way a host runs it: it refuses to write into the unsafe folder, and a script whose
folder was renamed and planted between the write and the start is not run. Over real SSH:
tests/backends/ssh/test_ssh_places.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrate.backends.ssh.channels import agent_source
from orchestrate.hostside import safeplace
from orchestrate.hostside.shipping import compact
from tests.support.agentreplies import agent_replies
from tests.support.fakesmi import fake_nvidia_smi
from tests.support.labserver import LAB
from tests.support.unixusers import User, unix_users

pytestmark = pytest.mark.process


@dataclass
class Lab:
    ann: User
    ben: User
    project: Path  # 2775 root:lab
    group: str


@pytest.fixture
def lab() -> Iterator[Lab]:
    tag = uuid.uuid4().hex[:5]
    folder = Path(f"/var/tmp/orchestrate-places-{tag}")
    folder.mkdir(mode=0o755)
    group = f"lab{tag}"
    try:
        (folder / "book").mkdir()
        (folder / "book").chmod(0o1777)
        bin_dir = fake_nvidia_smi(folder / "bin", LAB)
        env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
               "ORCHESTRATE_LEASES": str(folder / "book" / "leases")}
        with unix_users(folder, [f"pa{tag}", f"pb{tag}"], env) as (ann, ben):
            subprocess.run(["groupadd", group], check=True, capture_output=True)
            for user in (ann, ben):
                subprocess.run(["usermod", "-aG", group, user.name], check=True,
                               capture_output=True)
            project = folder / "project"
            project.mkdir()
            shutil.chown(project, "root", group)
            project.chmod(0o2775)
            for user in (ann, ben):
                user.env["ORCHESTRATE_RUNS"] = str(project / "runs" / user.name)
            yield Lab(ann, ben, project, group)
    finally:
        subprocess.run(["groupdel", group], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def _job(user: User, name: str, command: str) -> str:
    path = user.home / f"{name}.yaml"
    path.write_text(f"name: {name}\nresources: {{nodes: 1, gpus_per_node: 1, "
                    f"gpu_model: RTX-A6000}}\ndistributed: {{master_port: auto}}\n"
                    f"command: [bash, -c, {json.dumps(command)}]\n")
    path.chmod(0o644)
    return str(path)


def _plant(ben: User, run_dir: Path, marker: Path) -> None:
    """ben's launch script and sitecustomize.py, in a run dir of his own at ``run_dir``."""
    script = (f"mkdir -p {run_dir}/sidecar && "
              f"echo 'touch {marker}' > {run_dir}/launch-localhost.sh && "
              f"echo 'open(\"{marker}\", \"w\")' > {run_dir}/sidecar/sitecustomize.py && "
              f"chmod -R a+rwx {run_dir}")
    ben.sh(["sh", "-c", script], check=True)


@pytest.mark.timeout(240)
def test_a_run_root_in_a_group_project_folder_is_refused_naming_the_folder(lab: Lab) -> None:
    ann, ben = lab.ann, lab.ben
    runs = lab.project / "runs"
    ann.sh(["mkdir", "-p", str(runs / ann.name)], check=True)  # her runs, as she'd keep them
    job = f"j-{ann.name}"
    # ben may rename ann's runs/ (the folder above is the group's) and plant his own.
    assert ben.sh(["mv", str(runs), str(lab.project / "ann-was-here")]).returncode == 0
    marker = lab.project / "planted-ran"
    _plant(ben, runs / ann.name / job, marker)
    done = ann.run("submit", _job(ann, "j", "echo mine"), "--job-id", job, timeout=120)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"{lab.project} (owner root:{lab.group}, mode 2775) is writable by group " \
           f"{lab.group}" in said, said
    assert f"chmod +t {lab.project}" in said and "ORCHESTRATE_RUNS" in said, said
    assert not marker.exists()
    assert ann.run("status", job).returncode != 0  # nothing was recorded


@pytest.mark.timeout(240)
def test_in_a_sticky_project_folder_the_job_runs_its_own_script(lab: Lab) -> None:
    ann, ben = lab.ann, lab.ben
    lab.project.chmod(0o3775)  # what root does once: members keep what is theirs
    job = f"s-{ann.name}"
    out = ann.home / "out.txt"
    ann.run("submit", _job(ann, "s", f"sleep 3; echo mine > {out}"), "--detach", "--job-id",
            job, check=True)
    ann.until(job, "RUNNING")
    runs = lab.project / "runs"
    tried = ben.sh(["mv", str(runs), str(lab.project / "ann-was-here")])
    assert tried.returncode != 0 and "not permitted" in tried.stderr, tried.stderr
    run_dir = runs / ann.name / job
    assert ben.sh(["ls", str(run_dir)]).returncode != 0  # private: 0700, ann's
    status = ann.until(job, "COMPLETED", timeout=60)
    assert status["state"] == "COMPLETED" and out.read_text() == "mine\n"


def _agent(user: User, *requests: dict[str, object]) -> list[tuple[str, dict[str, object]]]:
    """The SSH agent's program run as ``user`` (as an SSH host runs it): its replies."""
    env = [f"{k}={v}" for k, v in user.env.items()]
    proc = subprocess.run(
        ["setpriv", f"--reuid={user.uid}", f"--regid={user.uid}", "--init-groups", "--",
         "env", "-i", *env, user.python, "-S", "-c", compact(agent_source()), "serve"],
        input="".join(json.dumps(r) + "\n" for r in requests), cwd=user.home,
        capture_output=True, text=True, timeout=60)
    return agent_replies(proc)


@pytest.mark.timeout(120)
def test_the_agent_refuses_an_unsafe_folder_and_a_script_planted_after_the_write(
        lab: Lab) -> None:
    ann, ben = lab.ann, lab.ben
    run_dir = lab.project / "runs" / ann.name / "job1"
    files = {"launch-h1.sh": "echo mine\n", "sidecar/sitecustomize.py": "\n"}
    [_, (kind, reply)] = _agent(ann, {"op": "files", "run_dir": str(run_dir), "files": files})
    assert kind == "files" and reply["ok"] is False
    unsafe = safeplace.optional_unsafe(reply)
    assert unsafe is not None and unsafe.folder == str(lab.project)
    assert (unsafe.owner, unsafe.mode) == (f"root:{lab.group}", "2775")
    assert f"chmod +t {lab.project}" in str(reply["detail"])
    # Written into the sticky folder; then the bit is dropped and ben swaps the folder.
    lab.project.chmod(0o3775)
    [_, (kind, reply)] = _agent(ann, {"op": "files", "run_dir": str(run_dir), "files": files})
    assert reply["ok"] is True and reply.get("unsafe") is None, reply
    lab.project.chmod(0o2775)
    ben.sh(["mv", str(lab.project / "runs"), str(lab.project / "ann-was-here")], check=True)
    marker = lab.project / "planted-ran"
    _plant(ben, run_dir, marker)
    start = {"op": "start", "job_id": "job1", "script": f"{run_dir}/launch-h1.sh",
             "local_rank": 0, "grace_s": 1, "lease_dir": str(lab.project.parent / "book")}
    [_, (kind, reply)] = _agent(ann, start)
    assert kind == "error" and f"refused to run {run_dir}/launch-h1.sh" in str(reply["detail"])
    assert f"{lab.project} (owner root:{lab.group}, mode 2775)" in str(reply["detail"])
    assert not marker.exists()
    assert os.stat(lab.project / "ann-was-here" / ann.name / "job1").st_uid == ann.uid


@pytest.mark.timeout(120)
def test_a_program_run_later_by_its_path_is_checked_again_right_before(lab: Lab) -> None:
    """Issue #32, class 1, for what runs after the launch: an SSH host runs the run
    directory's ``evidence.py`` for the stall watch (the command the controller sends, which
    re-checks the whole path first). Before any swap it runs ann's program; once ben has
    renamed her ``runs/`` in the project folder (its sticky bit dropped) and planted his own
    ``evidence.py`` there, the check refuses, naming the folder, and his program never runs."""
    from orchestrate.backends.ssh.evidence import evidence_command

    ann, ben = lab.ann, lab.ben
    run_dir = lab.project / "runs" / ann.name / "job2"
    lab.project.chmod(0o3775)
    files = {"evidence.py": "print('mine')\n", "sidecar/sitecustomize.py": "\n"}
    [_, (_, reply)] = _agent(ann, {"op": "files", "run_dir": str(run_dir), "files": files})
    assert reply["ok"] is True, reply
    command = evidence_command(ann.python, str(run_dir), "heartbeats")
    ran = ann.sh(["bash", "-c", command])
    assert ran.returncode == 0 and ran.stdout == "mine\n", ran.stderr
    lab.project.chmod(0o2775)
    ben.sh(["mv", str(lab.project / "runs"), str(lab.project / "ann-was-here")], check=True)
    marker = lab.project / "planted-ran"
    ben.sh(["sh", "-c", f"mkdir -p {run_dir}/sidecar && echo 'open(\"{marker}\", \"w\")' > "
            f"{run_dir}/evidence.py"], check=True)
    refused = ann.sh(["bash", "-c", command])
    assert refused.returncode == 2 and not marker.exists(), refused
    said = " ".join(refused.stderr.split())
    assert f"refused to run {run_dir}/evidence.py: unsafe place: " in said, said
    assert f"{lab.project} (owner root:{lab.group}, mode 2775)" in said
