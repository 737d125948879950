"""The SSH path a newcomer takes, on the real test hosts: a jump host is checked like the host
behind it, a host whose sshd allows few sessions still runs every rank, and a two-server job
probed through ssh_config aliases either runs or is refused before launch naming the cause
(issues #32 classes 5-6, #33 item 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from orchestrate.core.spec.inventory import load_inventory
from tests.support.sshcli import SshCli, assert_nothing_left
from tests.support.sshextra import client_config, extra_sshd, known_hosts_with

pytestmark = pytest.mark.ssh

RANKS_PROGRAM = """
import datetime, json, os, socket
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
print(json.dumps({"rank": dist.get_rank(), "host": socket.gethostname(),
                  "master": os.environ["MASTER_ADDR"]}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _probe(cli: SshCli, config: Path, *args: str) -> tuple[int, str]:
    proc = cli.run("inventory", "probe", *args, "--ssh-config", str(config), "--no-torch",
                   "--python", sys.executable, "--connect-timeout", "5", timeout=90)
    return proc.returncode, " ".join((proc.stdout + proc.stderr).split())


def _job(cli: SshCli, inventory: str, nodes: int, name: str = "reach") -> Path:
    cli.write("ranks.py", RANKS_PROGRAM)
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        backend: ssh
        inventory: {inventory}
        resources: {{nodes: {nodes}, gpus_per_node: all}}
        command: [python, ranks.py]
        distributed: {{timeout_s: 60}}
        """)


def _ranks(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line.partition(" ")[2]) for line in stdout.splitlines()
            if line.startswith("[") and line.partition(" ")[2].startswith("{")]


@pytest.mark.timeout(180)
def test_a_jump_host_is_checked_like_the_host_behind_it(ssh_cli: SshCli, tmp_path: Path
                                                        ) -> None:
    hosts = ssh_cli.hosts
    h1, h2 = hosts.hosts[0][1], hosts.hosts[1][1]
    entries = {"bastion": f"HostName {h1}", "inner": f"HostName {h2}\nProxyJump bastion"}
    good = client_config(hosts, tmp_path / "good_config", entries)
    code, said = _probe(ssh_cli, good, "inner", "-o", str(tmp_path / "inv.yaml"), "--yes")
    assert code == 0, said
    # Reached through h1: the alias does not resolve, so its HostName is written as address.
    (node,) = load_inventory(tmp_path / "inv.yaml").nodes
    assert (node.name, node.address) == ("inner", h2)

    # A bastion whose key changed is refused as a changed target key is, naming the hop ...
    changed = known_hosts_with(hosts, tmp_path / "changed_known_hosts", changed="h1")
    config = client_config(hosts, tmp_path / "changed_config", entries, changed)
    code, said = _probe(ssh_cli, config, "inner")
    assert code == 1, said
    assert (f"inner: host key of jump host {h1}:22 (ProxyJump towards inner) does NOT match "
            f"known_hosts ({changed}): refused") in said, said
    # ... as OpenSSH refuses the same config.
    assert hosts.run("inner", "hostname", "-F", str(config)).returncode != 0

    # An unknown bastion key is refused too, with the line that adds it.
    unknown = known_hosts_with(hosts, tmp_path / "unknown_known_hosts", dropped="h1")
    config = client_config(hosts, tmp_path / "unknown_config", entries, unknown)
    code, said = _probe(ssh_cli, config, "inner")
    assert code == 1, said
    assert (f"inner: unknown host key for jump host {h1}:22 (ProxyJump towards inner): "
            f"not in {unknown}") in said, said
    assert f"ssh-keyscan {h1} >> {unknown}" in said


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_a_host_allowing_two_sessions_runs_four_ranks(ssh_cli: SshCli, tmp_path: Path
                                                      ) -> None:
    hosts = ssh_cli.hosts
    h1 = hosts.hosts[0][1]
    known = known_hosts_with(hosts, tmp_path / "known_hosts", extra=f"[{h1}]:2222")
    with extra_sshd(hosts, "h1", tmp_path, MaxSessions="2") as port:
        ssh_cli.inventory([{"name": "h1", "slots": 4, "ssh": {"port": port}}],
                          known_hosts_file=str(known))
        job = _job(ssh_cli, "inv.yaml", nodes=1, name="small")
        proc = ssh_cli.run("submit", str(job), "--follow", "--job-id", "small-1", timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "ChannelException" not in proc.stdout + proc.stderr
        assert sorted(int(str(r["rank"])) for r in _ranks(proc.stdout)) == [0, 1, 2, 3]
        refusals = (tmp_path / "extra-sshd.log").read_text().count("no more sessions")
        assert refusals >= 1  # the host did refuse: what was checked is the way around it
    assert ssh_cli.status("small-1")["state"] == "COMPLETED"
    assert_nothing_left(ssh_cli, "small-1")

    # A host that takes no session at all is named as such, not with paramiko's exception.
    with extra_sshd(hosts, "h1", tmp_path, MaxSessions="0") as port:
        code, said = _probe(ssh_cli, hosts.ssh_config, "h1", "--port", str(port),
                            "--known-hosts", str(known), "--identity", str(hosts.key))
    assert code == 1, said
    assert "h1: h1 refuses every session on a new SSH connection (" in said, said
    assert "sshd's MaxSessions is 0, or its configuration forbids sessions" in said


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_a_newcomer_probes_two_aliases_and_runs_a_two_node_job(ssh_cli: SshCli,
                                                               tmp_path: Path) -> None:
    hosts = ssh_cli.hosts
    (_, h1), (_, h2) = hosts.hosts[:2]
    config = client_config(hosts, tmp_path / "ssh_config",
                           {"gpu-a": f"HostName {h1}", "gpu-b": f"HostName {h2}"})
    # -o into a folder that does not exist yet: it is made.
    written = ssh_cli.work / "newdir" / "lab.yaml"
    code, said = _probe(ssh_cli, config, "gpu-a", "gpu-b", "-o", str(written), "--yes")
    assert code == 0, said
    nodes = load_inventory(written).nodes
    assert [(n.name, n.address) for n in nodes] == [("gpu-a", h1), ("gpu-b", h2)]

    job = _job(ssh_cli, str(written), nodes=2)
    proc = ssh_cli.run("submit", str(job), "--follow", "--job-id", "reach-1", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _ranks(proc.stdout)
    assert {str(r["host"]) for r in ranks} == {"h1", "h2"}
    assert {str(r["master"]) for r in ranks} == {h1}
    assert_nothing_left(ssh_cli, "reach-1")

    # The same inventory without the addresses (what probe wrote before): MASTER_ADDR is an
    # alias no node resolves. Refused before launch, each node named with the cause.
    text = written.read_text().replace(f"address: {h1}", "").replace(f"address: {h2}", "")
    bare = ssh_cli.write("no-address.yaml", text)
    assert "address:" not in bare.read_text()
    job = _job(ssh_cli, str(bare), nodes=2, name="bare")
    proc = ssh_cli.run("submit", str(job), "--follow", "--job-id", "bare-1", timeout=120)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, said
    for node in ("gpu-a", "gpu-b"):
        assert f"{node}: master: MASTER_ADDR gpu-a does not resolve here" in said, said
    assert "hint: every node must resolve and reach MASTER_ADDR" in said
    assert not any(line.startswith("[gpu-") for line in proc.stdout.splitlines())
