"""Jobs in containers on the SSH test hosts: podman, one container per host (docs/containers.md).

The image is built here (tests/support/containers.py) and every host shares this machine's
podman store; a host's container runs in that host's network namespace (--network=host), so
the ranks of two hosts meet over the hosts' own addresses as they do without a container.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.support.containers import container_section, containers_of
from tests.support.sshcli import SshCli
from tests.support.sshhosts import tagged_on

pytestmark = pytest.mark.ssh

PROGRAM = """
import datetime, json, os, socket, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(json.dumps({"rank": os.environ["RANK"], "sum": t.item(),
                  "inside": os.path.exists("/run/.containerenv"),
                  "tag": os.environ.get("ORCHESTRATE_JOB_ID"),
                  "master": os.environ["MASTER_ADDR"]}), flush=True)
dist.destroy_process_group()
if os.environ["LOCAL_RANK"] == "1":  # the node's ranks end apart (each has its own SSH agent)
    time.sleep(2)
"""


def _cgroup_mounts_script() -> str:
    """A shell script mounting this machine's cgroup hierarchies where they are missing.

    The test hosts run under ``ip netns exec``, which mounts a fresh sysfs for the host's
    network namespace: ``/sys/fs/cgroup`` is empty there, and runc refuses to create a
    container ("no cgroup mount found in mountinfo"). A real server has them; each host's
    mount namespace is its own, so mounting them there changes nothing outside the host."""
    lines = ["set -e", "[ -z \"$(ls -A /sys/fs/cgroup)\" ] || exit 0  # there already"]
    for entry in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = entry.partition(" - ")
        point, (fstype, _source, options) = left.split()[4], right.split()[:3]
        if not point.startswith("/sys/fs/cgroup"):
            continue
        kind = "tmpfs" if fstype == "tmpfs" else fstype
        wanted = ",".join(o for o in options.split(",") if o not in ("rw", "ro"))
        wanted = f"none,{wanted}" if wanted.startswith("name=") else wanted
        lines.append(f"mkdir -p {point} && mount -t {kind} -o {wanted or 'defaults'} "
                     f"{kind} {point}")
    return "\n".join(lines)


def _reports(stdout: str) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for line in stdout.splitlines():
        prefix, _, rest = line.partition(" ")
        if prefix.startswith("[h") and rest.startswith("{"):
            found.append((prefix, json.loads(rest)))
    return found


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_two_hosts_run_their_ranks_in_containers(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 2}, {"name": "h2", "slots": 2}])
    for name in ("h1", "h2"):
        done = ssh_cli.hosts.run(name, f"bash -c {shlex.quote(_cgroup_mounts_script())}")
        assert done.returncode == 0, done.stdout + done.stderr
    ssh_cli.write("boxed.py", PROGRAM)
    job = ssh_cli.write("boxed.yaml", f"""
        name: boxed
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 2, gpus_per_node: all}}
        command: [python, boxed.py]
        distributed: {{timeout_s: 60}}
        container: {container_section()}
        """)
    proc = ssh_cli.run("submit", str(job), "--follow", "--job-id", "boxed-1", timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = _reports(proc.stdout)
    assert sorted(r["rank"] for _, r in reports) == ["0", "1", "2", "3"], proc.stdout
    for _, r in reports:
        assert r["inside"] is True and r["sum"] == 10.0 and r["tag"] == "boxed-1"
    assert {p.split(":")[0] for p, _ in reports} == {"[h1", "[h2"}
    assert ssh_cli.status("boxed-1")["state"] == "COMPLETED"
    # Removed by the node's last rank before it ends, so before the job ends: a background
    # remover was swept with the first rank's agent and left both containers running.
    assert containers_of("boxed-1") == []
    assert tagged_on(ssh_cli.hosts, "boxed-1") == {}
