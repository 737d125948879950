"""A job over several nodes is refused before launch when its nodes could not reach rank 0: a
loopback MASTER_ADDR, or a node probed on this machine (127.0.0.1) mixed with remote ones.
Without the refusal such a job waits in rendezvous until its timeout (issue #33, item 2)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from orchestrate.core.errors import UserError
from orchestrate.core.plan.ports import is_loopback
from orchestrate.run.prepare import prepare

pytestmark = pytest.mark.unit


def _files(tmp_path: Path, nodes: str, distributed: str = "") -> tuple[Path, Path]:
    inv = tmp_path / "inv.yaml"
    inv.write_text("name: lab\ndefaults: {python: python3}\nnodes:\n" + textwrap.dedent(nodes))
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent("""\
        name: two
        backend: ssh
        inventory: inv.yaml
        resources: {nodes: 2, gpus_per_node: all}
        command: [python, train.py]
        """) + distributed)
    return inv, job


def _refusal(job: Path) -> UserError:
    with pytest.raises(UserError) as caught:
        prepare(job)
    return caught.value


def test_a_locally_probed_node_beside_a_remote_one_is_refused_at_its_line(
        tmp_path: Path) -> None:
    inv, job = _files(tmp_path, """\
        - name: gpu-a
          address: 198.18.8.11
          slots: 2
        - name: localhost
          address: 127.0.0.1
          slots: 2
        """)
    error = _refusal(job)
    assert error.exit_status == 2
    text = str(error)
    assert text.startswith(f"{inv}:8: nodes.1.address: node localhost has the loopback "
                           "address 127.0.0.1 in a job over 2 nodes"), text
    assert "inventory probe --local" in text
    assert "(got 127.0.0.1)" in text and "hint: give node localhost the address" in text


def test_a_loopback_first_node_would_make_a_loopback_master(tmp_path: Path) -> None:
    inv, job = _files(tmp_path, """\
        - name: here
          address: 127.0.0.1
          slots: 2
        - name: gpu-b
          address: 198.18.8.12
          slots: 2
        """)
    text = str(_refusal(job))
    assert f"{inv}:5: nodes.0.address: node here" in text
    assert "rank 0's node, so MASTER_ADDR would be loopback" in text


def test_a_loopback_master_addr_in_the_job_is_refused_at_its_line(tmp_path: Path) -> None:
    _, job = _files(tmp_path, """\
        - name: gpu-a
          address: 198.18.8.11
          slots: 2
        - name: gpu-b
          address: 198.18.8.12
          slots: 2
        """, "distributed: {master_addr: localhost}\n")
    text = str(_refusal(job))
    assert text.startswith(f"{job}:6: distributed.master_addr: MASTER_ADDR localhost is "
                           "loopback, and this job spans 2 nodes"), text


def test_nodes_that_are_all_this_machine_are_planned(tmp_path: Path) -> None:
    # Every node says loopback: they are all this machine, where the store is reachable.
    _, job = _files(tmp_path, """\
        - name: h1
          address: 127.0.0.1
          slots: 2
        - name: h2
          address: 127.0.0.2
          slots: 2
        """)
    assert prepare(job).plan.master_addr == "127.0.0.1"


def test_one_node_on_loopback_and_remote_nodes_are_planned(tmp_path: Path) -> None:
    _, job = _files(tmp_path, """\
        - name: gpu-a
          address: 198.18.8.11
          slots: 2
        - name: gpu-b
          slots: 2
        """)
    assert prepare(job).plan.master_addr == "198.18.8.11"
    one = tmp_path / "one.yaml"
    one.write_text(job.read_text().replace("nodes: 2", "nodes: 1"))
    (tmp_path / "inv.yaml").write_text(
        "name: lab\nnodes:\n  - {name: localhost, address: 127.0.0.1, slots: 2}\n")
    assert prepare(one).plan.master_addr == "127.0.0.1"


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("LocalHost", True), ("198.18.8.11", False), ("h1", False),
    ("localhost-gpu", False), ("10.127.0.1", False)])
def test_loopback_is_read_off_the_address_as_written(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback
