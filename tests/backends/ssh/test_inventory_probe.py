"""``inventory probe HOST...`` and ``inventory check`` over SSH, on the real test hosts.

Each host is its own network namespace with a veth ``eth0`` (10000 Mb/s in its sysfs) on a
shared bridge, so "the interface that routes to the other hosts" is a real answer, not this
machine's. The gatherer runs on the hosts for real (``python -S -c PROGRAM``); only the GPUs are
stood in: h1's python is a wrapper that puts tests/probe's stand-in ``nvidia-smi`` (replaying
the mixed A100 + RTX A6000 server) on PATH, the way site wrappers (module load) set PATH.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrate.core.spec.inventory import load_inventory
from tests.support.sshcli import SshCli
from tests.support.sshhosts import SshHosts

pytestmark = pytest.mark.ssh

PROBE_TESTS = Path(__file__).resolve().parents[2] / "probe"
#: In the hosts' /24 (so the route to it is the bridge's), but no host has it: nobody answers.
NO_HOST = "198.18.8.99"


def ssh_flags(hosts: SshHosts) -> list[str]:
    """How a user points probe at the hosts: the files sshhosts.sh wrote."""
    return ["--ssh-config", str(hosts.ssh_config), "--known-hosts", str(hosts.known_hosts),
            "--identity", str(hosts.key)]


def probe(cli: SshCli, *args: str) -> subprocess.CompletedProcess[str]:
    return cli.run("inventory", "probe", *args, timeout=90)


def check(cli: SshCli, path: Path) -> subprocess.CompletedProcess[str]:
    return cli.run("inventory", "check", str(path), timeout=90)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in\n{text}"
    path.write_text(text.replace(old, new))


def on_host(hosts: SshHosts, name: str, command: str) -> str:
    """What ``command`` prints on the host, asked over ssh as a user would."""
    result = hosts.run(name, command)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.timeout(120)
def test_probe_writes_the_hosts_and_check_names_each_difference(ssh_cli: SshCli) -> None:
    hosts = ssh_cli.hosts
    names = [name for name, _ in hosts.hosts]
    path = ssh_cli.work / "hosts.yaml"
    result = probe(ssh_cli, *names, NO_HOST, *ssh_flags(hosts), "--python", sys.executable,
                   "--connect-timeout", "5", "-o", str(path), "--yes")
    # The host that does not answer is named, the others are written, and the exit says so.
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{NO_HOST}: unreachable: {NO_HOST}:22: " in result.stdout
    assert ssh_cli.run("validate", str(path)).returncode == 0
    inv = load_inventory(path)
    assert [n.name for n in inv.nodes] == names
    text = path.read_text()
    assert f'- name: "h[1-{len(names)}]"' in text  # identical hosts share one entry
    for node in inv.nodes:
        assert node.slots == int(on_host(hosts, node.name, "nproc"))
        assert node.network is not None
        speed = int(on_host(hosts, node.name, "cat /sys/class/net/eth0/speed"))
        assert (node.network.interface, node.network.fabric, node.network.gbps) == (
            "eth0", "ethernet", speed / 1000)
        assert node.python == sys.executable
        assert node.ssh.config_file == str(hosts.ssh_config)

    # The file carries how the hosts were reached: check needs nothing else.
    result = check(ssh_cli, path)
    assert (result.returncode, result.stdout) == (0, f"{path}: all 3 node(s) match\n"), \
        result.stderr
    edit(path, "gbps: 10}", "gbps: 100}")
    result = check(ssh_cli, path)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == [
        *(f"{name}: network.gbps: eth0 runs at 10 Gb/s, the inventory says 100 Gb/s"
          for name in names),
        f"3 difference(s) on 3 node(s) of {path}",
    ]


def gpu_python(cli: SshCli) -> str:
    """A python for h1 that finds the stand-in nvidia-smi of tests/probe on its PATH."""
    bin_dir = cli.work / "gpubin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n" + (PROBE_TESTS / "fake_nvidia_smi.py").read_text())
    smi.chmod(0o755)
    wrapper = bin_dir / "python"
    fixture = PROBE_TESTS / "fixtures" / "ambers-a100-a6000"
    wrapper.write_text(f'#!/bin/sh\nPATH={bin_dir}:$PATH FAKE_NVSMI_DIR={fixture} '
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.timeout(120)
def test_from_an_inventory_reuses_its_settings_and_a_gpu_host_gets_its_groups(
    ssh_cli: SshCli,
) -> None:
    wrapper = gpu_python(ssh_cli)
    source = ssh_cli.inventory([{"name": "h1", "slots": 1, "python": wrapper},
                                {"name": "h2", "slots": 1}, {"name": "h3", "slots": 1}])
    path = ssh_cli.work / "gpus.yaml"
    result = probe(ssh_cli, "--from", str(source), "--no-torch", "-o", str(path), "--yes")
    assert result.returncode == 0, result.stdout + result.stderr
    assert ssh_cli.run("validate", str(path)).returncode == 0
    inv = load_inventory(path)
    h1, h2, h3 = inv.nodes
    assert [(g.index, g.model, g.memory_gb) for g in h1.gpus] == [
        (0, "A100-80GB", 80), (1, "A100-80GB", 80),
        *((i, "RTX-A6000", 48) for i in range(2, 8))]
    assert (h1.gpu_link, h1.python) == ("pcie", wrapper)
    assert (h2.slots, h3.slots) == (h1.cpus, h1.cpus)
    # What the source file said about reaching them is kept: addresses, ssh settings, python.
    addresses = dict(ssh_cli.hosts.hosts)
    assert [(n.address, n.ssh.identity_file) for n in inv.nodes] == [
        (addresses[n.name], str(ssh_cli.hosts.key)) for n in inv.nodes]
    assert h2.python == sys.executable
    text = path.read_text()
    assert "  # probed " in text and ": driver 550.54.15" in text

    result = ssh_cli.run("inventory", "check", "--no-torch", str(path), "--json", timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["ok"] is True
    # Probing again with the written file's own settings changes nothing in it.
    before = path.read_text()
    result = probe(ssh_cli, "--from", str(path), "--no-torch", "-o", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{path} is up to date" in result.stdout
    assert path.read_text() == before
    edit(path, "indices: [2, 3, 4, 5, 6, 7]}", "indices: [2, 3, 4, 5, 6, 7, 8]}")
    result = ssh_cli.run("inventory", "check", "--no-torch", str(path), timeout=90)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == [
        "h1: gpus: GPU 8 (RTX-A6000, 48 GB) is declared but not found; nvidia-smi lists 8 GPU(s)",
        f"1 difference(s) on 1 node(s) of {path}",
    ]


@pytest.mark.timeout(60)
def test_host_keys_are_checked_as_the_ssh_backend_checks_them(ssh_cli: SshCli,
                                                              tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    flags = ["--ssh-config", str(ssh_cli.hosts.ssh_config), "--identity", str(ssh_cli.hosts.key),
             "--known-hosts", str(empty), "--no-torch", "--python", sys.executable]
    refused = probe(ssh_cli, "h1", *flags)
    assert refused.returncode == 1
    assert "h1: unknown host key for 198.18.8.11:22" in refused.stderr
    # The hint is the line to run (into the file that was read), not /dev/null named twice.
    said = " ".join(refused.stderr.split())
    assert f"ssh-keyscan 198.18.8.11 >> {empty}" in said, said
    assert "/dev/null" not in said
    assert refused.stdout == ""  # nothing probed, nothing printed as an inventory
    accepted = probe(ssh_cli, "h1", *flags, "--accept-unknown-host-keys")
    assert accepted.returncode == 0, accepted.stderr
    assert "accept_unknown_host_keys: true" in accepted.stdout
