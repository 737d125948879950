"""What a hostile run of the SSH path broke, each reproduced on the real test hosts and now held.

Hosts that differ where they must not: one host's python sees another torch than the others
(a ``torch`` package of another version first on its path), or cannot import orchestrate at
all (its python is a virtual environment with torch and without orchestrate). Both are what a
cluster that was upgraded halfway looks like.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.sshcli import SshCli

pytestmark = pytest.mark.ssh

REPO = Path(__file__).resolve().parents[3]


def _python_with_old_torch(cli: SshCli) -> Path:
    """A node python that imports a torch 2.5.1 (a package of that version first on its path)."""
    fake = cli.work / "old-torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.5.1"\n')
    wrapper = cli.work / "python-old-torch"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={fake.parent}${{PYTHONPATH:+:$PYTHONPATH}}\n"
                       f"export PYTHONPATH\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def _python_without_orchestrate(cli: SshCli) -> Path:
    """A node python with torch but no orchestrate: a virtual environment that sees this
    interpreter's site-packages as a plain path (their .pth files, orchestrate's editable
    install among them, are not run), with this checkout taken off PYTHONPATH."""
    venv = cli.work / "venv-no-orchestrate"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "real-site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wrapper = cli.work / "python-no-orchestrate"
    wrapper.write_text(
        "#!/bin/sh\n"
        "kept=''\nIFS=:\nfor d in $PYTHONPATH; do\n"
        f"  [ \"$d\" = {REPO} ] || kept=\"${{kept:+$kept:}}$d\"\ndone\nunset IFS\n"
        f"PYTHONPATH=$kept\nexport PYTHONPATH\nexec {venv}/bin/python \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def _job(cli: SshCli, name: str, nodes: int = 2) -> Path:
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: {nodes}, gpus_per_node: 1}}
        command: [python, -c, "print('the job ran')"]
        env: {{PYTHONPATH: "{REPO}"}}
        """)


@pytest.mark.timeout(120)
def test_submit_refuses_hosts_whose_torch_versions_differ_naming_both(ssh_cli: SshCli) -> None:
    old = _python_with_old_torch(ssh_cli)
    ssh_cli.inventory([{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1,
                                                     "python": str(old)}])
    job = _job(ssh_cli, "torches")
    ours = torch.__version__
    label = {name: f"{name} ({address})" for name, address in ssh_cli.hosts.hosts}
    dry = ssh_cli.run("submit", str(job), "--dry-run", "--job-id", "torches-0")
    assert dry.returncode == 2, dry.stdout + dry.stderr
    # The refusal names the odd host, both versions and the host with the other one.
    assert f"{label['h2']}: torch: torch 2.5.1 here, {ours} on h1" in dry.stderr, dry.stderr
    submitted = ssh_cli.run("submit", str(job), "--detach", "--job-id", "torches-1")
    assert submitted.returncode == 2, submitted.stdout + submitted.stderr
    assert f"torch 2.5.1 here, {ours} on h1" in submitted.stderr, submitted.stderr
    assert "Traceback" not in submitted.stderr
    assert ssh_cli.run("status", "torches-1").returncode == 2  # nothing was recorded
    # The same torch everywhere is launched as before.
    ssh_cli.inventory([{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1}])
    same = ssh_cli.run("submit", str(job), "--follow", "--job-id", "torches-2", check=True)
    assert "[h2:1] the job ran" in same.stdout


@pytest.mark.torch
@pytest.mark.timeout(200)
def test_the_doctor_blames_only_the_host_that_cannot_import_orchestrate(
        ssh_cli: SshCli) -> None:
    broken = _python_without_orchestrate(ssh_cli)
    ssh_cli.inventory([{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1},
                       {"name": "h3", "slots": 1, "python": str(broken)}])
    job = _job(ssh_cli, "noorch", nodes=3)
    proc = ssh_cli.run("doctor", str(job), "--json", "--tier", "static", timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    failed = [c for c in doc["checks"] if c["status"] == "fail"]
    brief = "\n".join(f"{c['tier']} {c['name']} {c['nodes']} {c['status']}: {c['detail']}"
                      for c in doc["checks"])
    assert failed and all(c["nodes"] == ["h3"] for c in failed), brief
    assert any("orchestrate" in c["detail"] for c in failed), brief
    assert not any(c["status"] == "fail" and set(c["nodes"]) & {"h1", "h2"}
                   for c in doc["checks"]), brief
