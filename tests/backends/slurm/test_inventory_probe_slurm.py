"""``inventory probe --slurm`` and ``inventory check`` through Slurm, on the real test cluster.

scontrol's node records say which nodes exist, their CPUs, state and partition; one srun task
per node runs the gatherer there (in the node's own network namespace, so the interface found
is the node's). A drained node is reported with Slurm's reason and not probed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchestrate.backends.slurm.ctl import parse_show_node
from orchestrate.core.spec.inventory import load_inventory
from tests.support.clusters import BRING_UP
from tests.support.slurmcli import OrchestrateCli
from tests.support.slurmcluster import SlurmCluster

pytestmark = pytest.mark.slurm



@pytest.fixture
def drained(slurm_cluster: SlurmCluster) -> Iterator[str]:
    """The last node, drained for the test (and resumed after it, whatever happened)."""
    node = slurm_cluster.nodes[-1]
    slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=drain",
                      "reason=probe test")
    try:
        yield node
    finally:
        slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)


def cpus(cluster: SlurmCluster, node: str) -> int:
    record = parse_show_node(cluster.run("scontrol", "show", "node", "-o", node).stdout)[0]
    return int(record["CPUTot"])


@pytest.mark.timeout(BRING_UP + 60)
def test_probe_slurm_writes_its_nodes_and_partition_and_check_passes(ocli: OrchestrateCli) -> None:
    cluster = ocli.cluster
    path = ocli.work / "cluster.yaml"
    result = ocli.run("inventory", "probe", "--slurm", "--partition", "debug", "-o", str(path),
                      "--yes", timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ocli.run("validate", str(path)).returncode == 0
    inv = load_inventory(path)
    assert [n.name for n in inv.nodes] == list(cluster.nodes)
    text = path.read_text()
    assert "defaults:\n  slurm: {partition: debug}\n" in text
    assert f'- name: "n[1-{len(cluster.nodes)}]"' in text  # identical nodes, one entry
    for node in inv.nodes:
        assert node.partition == "debug"
        assert node.slots == node.cpus == cpus(cluster, node.name)  # Slurm's, not the task's 1
        if cluster.layout == "netns":  # each node has its own eth0 towards the others
            assert node.network is not None and node.network.interface == "eth0"
    # The file says its nodes are Slurm's: check goes through srun too.
    result = ocli.run("inventory", "check", str(path), timeout=90)
    assert (result.returncode, result.stdout) == (
        0, f"{path}: all {len(cluster.nodes)} node(s) match\n"), result.stderr


@pytest.mark.timeout(BRING_UP + 60)
def test_a_drained_node_is_reported_not_probed(ocli: OrchestrateCli, drained: str) -> None:
    cluster = ocli.cluster
    path = ocli.work / "rest.yaml"
    result = ocli.run("inventory", "probe", "--slurm", "--no-torch", "-o", str(path), "--yes",
                      timeout=90)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{drained}: Slurm says IDLE+DRAIN (drained: probe test [" in result.stdout
    others = [n for n in cluster.nodes if n != drained]
    assert [n.name for n in load_inventory(path).nodes] == others
    # A file that lists the drained node: check names it and exits 1.
    edit = path.read_text().replace(f'"n[1-{len(others)}]"', f'"n[1-{len(cluster.nodes)}]"')
    path.write_text(edit)
    result = ocli.run("inventory", "check", "--no-torch", str(path), timeout=90)
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith(f"{drained}: could not be probed: Slurm says IDLE+DRAIN")
