"""``inventory probe``: the inventory a person would write, from the machine itself.

Each captured machine is probed for real (the gatherer runs the stand-in nvidia-smi and reads
the fake sysfs) and written through the same code path as the CLI; the result must equal the
golden file and pass ``orchestrate validate``.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
from pathlib import Path
from typing import Any

import pytest

from orchestrate.cli.inventory import write_probed
from orchestrate.core.spec.inventory import load_inventory
from orchestrate.probe.gathering import Unreachable
from orchestrate.probe.machine import gather_local
from tests.support.probemachine import check_golden, cli, machine, normalise

pytestmark = pytest.mark.process


def probe(tmp: Path, box: str | None, **env: str) -> dict[str, Any]:
    """The raw facts of a captured machine, gathered for real."""
    with machine(tmp, box, **env):
        return gather_local(torch=False)


def write(tmp: Path, name: str, gathered: dict[str, Any], **kwargs: Any) -> tuple[int, Path]:
    path = tmp / f"{name}.yaml"
    code = write_probed(gathered, output=path, yes=True, **kwargs)
    return code, path


def test_an_nvswitch_cluster_folds_into_one_hostlist_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    facts = probe(tmp_path, "h100-nvswitch")
    code, path = write(tmp_path, "cluster", {f"gpu{i:02d}": facts for i in range(1, 17)})
    assert code == 0
    check_golden("h100-nvswitch.yaml", normalise(path.read_text()))
    assert cli("validate", path).code == 0
    inv = load_inventory(path)
    assert [n.name for n in inv.nodes] == [f"gpu{i:02d}" for i in range(1, 17)]
    node = inv.nodes[0]
    assert node.gpu_link == "nvswitch" and node.models() == {"H100-80GB": 8}
    assert node.network is not None and (node.network.fabric, node.network.hca) == (
        "infiniband", "mlx5_0")
    table = capsys.readouterr().out
    assert "8x H100-80GB 80GB [0,1,2,3,4,5,6,7]" in table


def test_nvlink_pairs_and_roce(tmp_path: Path) -> None:
    facts = probe(tmp_path, "a100-nvlink-pairs")
    code, path = write(tmp_path, "pairs", {"nvl01": facts, "nvl02": facts})
    assert code == 0
    check_golden("a100-nvlink-pairs.yaml", normalise(path.read_text()))
    assert "# topology: NV12 pairs 0-1, 2-3, 4-5, 6-7; others NODE/SYS; PCIe Gen4 x16" in \
        path.read_text()
    node = load_inventory(path).nodes[1]
    assert node.gpu_link == "nvlink"
    assert [(i.gpus, i.via) for i in node.islands] == [
        ((0, 1), "nvlink"), ((2, 3), "nvlink"), ((4, 5), "nvlink"), ((6, 7), "nvlink")]


def test_the_mixed_a100_a6000_server_is_the_readmes_ambers(tmp_path: Path) -> None:
    facts = probe(tmp_path, "ambers-a100-a6000")
    code, path = write(tmp_path, "lab", {"ambers": facts})
    assert code == 0
    check_golden("ambers-a100-a6000.yaml", normalise(path.read_text()))
    node = load_inventory(path).nodes[0]
    assert [(g.index, g.model, g.memory_gb) for g in node.gpus] == [
        (0, "A100-80GB", 80), (1, "A100-80GB", 80), *[(i, "RTX-A6000", 48) for i in range(2, 8)]]
    assert node.gpu_link == "pcie"
    # two sockets: GPUs 0-3 on NUMA node 0, 4-7 on node 1 (topo -m's affinity columns)
    assert [(n.node, n.cpus, n.gpus) for n in node.numa] == [
        (0, "0-55,112-167", (0, 1, 2, 3)), (1, "56-111,168-223", (4, 5, 6, 7))]
    assert node.network is not None and node.network.model_dump() == {
        "interface": "eno1", "fabric": "ethernet", "gbps": 10, "hca": None}


def test_a_cpu_only_machine_becomes_a_slots_node(tmp_path: Path) -> None:
    facts = probe(tmp_path, "cpu")
    code, path = write(tmp_path, "cpus", {"cpu1": facts})
    assert code == 0
    node = load_inventory(path).nodes[0]
    cpus = len(os.sched_getaffinity(0))
    assert (node.gpus, node.slots, node.cpus, node.gpu_link) == ((), cpus, cpus, "none")
    assert "# probed " in path.read_text() and ": no NVIDIA GPU" in path.read_text()


def test_nvidia_smi_failing_is_reported_and_the_node_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = probe(tmp_path, "ambers-a100-a6000")
    bad = probe(tmp_path, "driver-mismatch")
    code, path = write(tmp_path, "lab", {"ambers": good, "birch": bad,
                                         "cedar": Unreachable("ssh: connection refused")})
    assert code == 1
    out = capsys.readouterr().out
    assert "birch: nvidia-smi failed: Failed to initialize NVML: Driver/library version " \
           "mismatch" in out
    assert "NVML library version: 570.124" in out
    assert "cedar: ssh: connection refused (left out of the inventory)" in out
    assert [n.name for n in load_inventory(path).nodes] == ["ambers"]


def test_probe_local_prints_a_valid_inventory_for_this_machine(chdir_tmp: Path) -> None:
    """The real machine: whatever it has, the printed file validates and names it."""
    result = cli("inventory", "probe", "--local", "--no-torch")
    assert result.code == 0, result.err
    assert "probed 1 node(s)" in result.err  # the table goes to stderr, the file to stdout
    (chdir_tmp / "local.yaml").write_text(result.out)
    assert cli("validate", "local.yaml").code == 0
    node = load_inventory(chdir_tmp / "local.yaml").nodes[0]
    assert (node.name, node.address) == ("localhost", "127.0.0.1")
    assert node.capacity >= 1


def test_probe_local_records_torchs_version(chdir_tmp: Path) -> None:
    """torch's version (read from its files by a bounded child of the node's python) is part
    of the provenance ``check`` compares."""
    result = cli("inventory", "probe", "--local", "-o", "here.yaml", "--name", "here")
    assert result.code == 0, result.err
    text = (chdir_tmp / "here.yaml").read_text()
    assert f", torch {importlib.metadata.version('torch')}" in text and "name: here" in text
    assert "wrote here.yaml" in result.out


@pytest.mark.unit
def test_probe_needs_something_to_probe() -> None:
    result = cli("inventory", "probe")
    assert result.code == 2
    assert "say which machines to probe" in result.err and "--local" in result.err


# ------------------------------------------------------------------------------------- merging

USER_FILE = """\
# The lab's servers. Ask Ana before adding one.
name: lab
defaults:
  ssh: {user: train, identity_file: ~/.ssh/lab}
  python: /opt/conda/envs/train/bin/python
  network: {interface: eno1, fabric: ethernet, gbps: 10}
nodes:
  # the old box under the desk
  - name: ambers
    address: ambers.lab.internal
    cpus: 64
    gpus:
      - {model: A100-80GB, memory_gb: 80, indices: [0, 1]}
      - {model: RTX-A6000, memory_gb: 40, indices: [2, 3, 4, 5]}
    slurm: {partition: lab}
  - name: birch  # reached through the bastion
    address: 10.1.2.4
    ssh: {port: 2222}
    gpus: [{model: RTX-A6000, memory_gb: 48, count: 4}]
"""


def test_merge_keeps_what_the_user_wrote_and_updates_probed_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text(USER_FILE)
    facts = probe(tmp_path, "ambers-a100-a6000")
    code = write_probed({"ambers": facts, "birch": Unreachable("timed out")}, output=path,
                        yes=True)
    assert code == 1  # birch could not be probed: reported, kept as it was
    text = path.read_text()
    check_golden("merged-lab.yaml", normalise(text))
    assert cli("validate", path).code == 0
    out = capsys.readouterr().out
    assert f"--- {path} (now)" in out and f"+++ {path} (probed)" in out
    assert "-      - {model: RTX-A6000, memory_gb: 40, indices: [2, 3, 4, 5]}" in out
    assert "+      - {model: RTX-A6000, memory_gb: 48, indices: [2, 3, 4, 5, 6, 7]}" in out
    inv = load_inventory(path)
    ambers, birch = inv.nodes
    assert (ambers.address, ambers.python, ambers.partition, ambers.ssh.user) == (
        "ambers.lab.internal", "/opt/conda/envs/train/bin/python", "lab", "train")
    assert len(ambers.gpus) == 8 and ambers.cpus == len(os.sched_getaffinity(0))
    assert (birch.address, birch.ssh.port, len(birch.gpus)) == ("10.1.2.4", 2222, 4)


def test_probing_again_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    facts = probe(tmp_path, "ambers-a100-a6000")
    code, path = write(tmp_path, "lab", {"ambers": facts})
    first = path.read_text()
    capsys.readouterr()
    code = write_probed({"ambers": facts}, output=path)  # no --yes: nothing to ask
    assert code == 0 and path.read_text() == first
    assert "is up to date" in capsys.readouterr().out


def test_a_hostlist_entry_is_split_when_its_nodes_differ(tmp_path: Path) -> None:
    h100 = probe(tmp_path, "h100-nvswitch")
    _, path = write(tmp_path, "cluster", {f"gpu{i:02d}": h100 for i in range(1, 5)})
    text = path.read_text().replace('- name: "gpu[01-04]"',
                                    '- name: "gpu[01-04]"\n    slurm: {partition: gpu}')
    assert text != path.read_text()
    path.write_text(text)
    pairs = probe(tmp_path, "a100-nvlink-pairs")
    write_probed({"gpu01": h100, "gpu02": h100, "gpu03": pairs, "gpu05": pairs}, output=path,
                 yes=True)
    inv = load_inventory(path)
    models = {n.name: (next(iter(n.models())), n.partition) for n in inv.nodes}
    assert models == {"gpu01": ("H100-80GB", "gpu"), "gpu02": ("H100-80GB", "gpu"),
                      "gpu03": ("A100-80GB", "gpu"), "gpu04": ("H100-80GB", "gpu"),
                      "gpu05": ("A100-80GB", None)}
    assert '- name: "gpu[01-02]"' in path.read_text()


def test_never_overwrites_without_a_yes_when_nobody_can_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text(USER_FILE)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a terminal
    with machine(tmp_path, "ambers-a100-a6000"):
        result = cli("inventory", "probe", "--local", "--no-torch", "-o", path)
    assert result.code == 2
    assert "exists and would change; not overwriting it without a yes" in result.err
    assert "--yes" in result.err
    assert "+++ " in result.out  # the diff was shown
    assert path.read_text() == USER_FILE


def test_a_flow_style_file_is_merged_and_stays_valid(tmp_path: Path) -> None:
    path = tmp_path / "flow.yaml"
    path.write_text("# lab\nname: lab\nnodes: [{name: ambers, address: a.lab, slots: 2}, "
                    "{name: birch, slots: 4}]\ndefaults: {python: /usr/bin/python3}\n")
    facts = probe(tmp_path, "ambers-a100-a6000")
    assert write_probed({"ambers": facts}, output=path, yes=True) == 0
    inv = load_inventory(path)
    ambers, birch = inv.nodes
    assert (ambers.address, ambers.python, len(ambers.gpus), ambers.slots) == (
        "a.lab", "/usr/bin/python3", 8, None)
    assert (birch.slots, birch.python) == (4, "/usr/bin/python3")
    assert path.read_text().startswith("# lab\n")


def test_probe_records_the_container_runtimes_a_node_has(tmp_path: Path) -> None:
    """``containers:`` lists what was found (podman here), and a job's default runtime comes
    from it (docs/containers.md)."""
    bin_dir = tmp_path / "bin-cpu"
    bin_dir.mkdir()
    podman = bin_dir / "podman"
    podman.write_text("#!/bin/sh\nexit 0\n")
    podman.chmod(0o755)
    facts = probe(tmp_path, "cpu")
    assert facts["containers"] == ["podman"]
    code, path = write(tmp_path, "boxes", {"box1": facts})
    assert code == 0
    assert "containers: [podman]" in path.read_text()
    assert load_inventory(path).nodes[0].containers == ("podman",)
    bare = probe(tmp_path / "none", None)
    assert bare["containers"] == []
