"""The transports' parts that need no cluster: the program a node runs (run here for real, as
the SSH server's shell runs it), its bound, srun's labelled output and scontrol's node records
(captured from the test cluster: slurm_outputs/SOURCE.md), and the command line's refusals.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrate.backends.slurm.ctl import parse_show_node
from orchestrate.backends.slurm.probe import Group, SlurmNode, blocker, read_tasks, srun_argv
from orchestrate.probe.gathering import (
    EXIT_EXPIRED,
    MAX_PEERS,
    Unreachable,
    facts_argv,
    failure,
    peers_of,
    read_facts,
    shell_command,
)
from tests.support.probemachine import PROBE_TESTS, cli, machine

pytestmark = pytest.mark.unit

OUTPUTS = PROBE_TESTS / "slurm_outputs"


def run_as_sshd_would(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """The command line through a login shell, as an SSH server runs a one-shot command."""
    return subprocess.run(["bash", "-c", shell_command(argv)], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.process
def test_the_shipped_program_runs_with_the_standard_library_and_routes_to_its_peers() -> None:
    done = run_as_sshd_would(facts_argv(sys.executable, ["127.0.0.1"], bound_s=30, torch=False))
    assert done.returncode == 0, done.stderr
    facts = read_facts(done.stdout)
    assert facts is not None
    assert facts["hostname"] == socket.gethostname()
    assert facts["routes"] == {"127.0.0.1": {"interface": "lo", "ip": "127.0.0.1"}}
    assert facts["torch"] is None


@pytest.mark.timing
@pytest.mark.process
def test_a_node_that_hangs_stops_itself_at_its_bound(tmp_path: Path) -> None:
    # nvidia-smi that does not answer for 20 s: the node gives up after its 1 s bound.
    with machine(tmp_path, "h100-nvswitch", FAKE_NVSMI_SLEEP="20"):
        started = time.monotonic()
        done = run_as_sshd_would(facts_argv(sys.executable, [], bound_s=1, torch=False))
        took = time.monotonic() - started
    assert done.returncode == EXIT_EXPIRED
    assert took < 10
    assert "gathering facts took over 1 s on this host" in done.stderr
    assert failure(sys.executable, done.returncode, done.stdout + done.stderr, 1).startswith(
        "gathering facts took over 1s on the host (a hung nvidia-smi?)")


def test_what_a_node_printed_around_its_facts_is_ignored_and_failures_are_named() -> None:
    line = '{"version": 1, "hostname": "h1", "cpus": {"count": 2}}'
    assert read_facts(f"Welcome to h1\n{line}\nwarning: something\n") == {
        "version": 1, "hostname": "h1", "cpus": {"count": 2}}
    assert read_facts("bash: python9: command not found\n") is None
    assert failure("python9", 127, "bash: line 1: python9: command not found\n", 60) == (
        "python9 not found on the host: bash: line 1: python9: command not found")
    assert failure("python3", 1, "SyntaxError: invalid syntax\n", 60) == (
        "python3 -S failed (exit status 1): SyntaxError: invalid syntax")


def test_each_node_asks_a_few_routes_and_every_node_is_asked_about() -> None:
    addresses = [f"10.0.0.{i}" for i in range(1, 21)]
    asked = [peers_of(addresses, i) for i in range(len(addresses))]
    assert asked[0] == addresses[1:1 + MAX_PEERS]
    assert asked[19] == addresses[:MAX_PEERS]  # round the ring
    assert all(len(p) == MAX_PEERS and addresses[i] not in p for i, p in enumerate(asked))
    assert {a for p in asked for a in p} == set(addresses)
    assert peers_of(["10.0.0.1"], 0) == ["10.0.0.1"]  # alone: the interface holding its address
    assert peers_of(addresses, None) == addresses[:MAX_PEERS]


# ------------------------------------------------------------------------------------- Slurm


def nodes() -> list[SlurmNode]:
    text = (OUTPUTS / "show_node.txt").read_text()
    return [SlurmNode.from_record(r) for r in parse_show_node(text)]


def test_scontrol_node_records_and_which_nodes_can_take_a_task() -> None:
    found = nodes()
    assert [(n.name, n.address, n.hostname, n.cpus, n.memory_mb, n.gres, n.partitions, n.state)
            for n in found] == [
        (f"n{i}", f"198.18.7.{i}", f"n{i}", 4, 4000, "", ("debug",), state)
        for i, state in ((1, "IDLE"), (2, "IDLE"), (3, "IDLE+DRAIN"))]
    n3 = found[2]
    assert n3.reason is not None and n3.reason.startswith("probe test [root@2026-")
    assert [blocker(n) for n in found] == [
        None, None, f"Slurm says IDLE+DRAIN (drained: {n3.reason}); not probed"]


@pytest.mark.parametrize(("state", "why"), [
    # State strings as scontrol prints them (base state, then +FLAGS; * = not responding).
    ("MIXED", None),
    ("ALLOCATED", "busy (every CPU allocated)"),
    ("DOWN*", "down, not responding"),
    ("IDLE*", "not responding"),
    ("MIXED+DRAIN", "draining"),
    ("DOWN+DRAIN+NOT_RESPONDING", "down, drained, not responding"),
    ("IDLE+CLOUD+POWERED_DOWN", "powered down"),
    ("FUTURE", "not in service yet"),
])
def test_node_states_slurm_will_not_run_a_task_in(state: str, why: str | None) -> None:
    node = SlurmNode(name="g1", address="g1", hostname="g1", cpus=8, memory_mb=None, gres="",
                     state=state, partitions=("gpu",))
    assert blocker(node) == (None if why is None else f"Slurm says {state} ({why}); not probed")


def test_gres_type_is_read_from_the_node_record() -> None:
    record = {"NodeName": "g1", "Gres": "gpu:a100:4(S:0-1),nic:1", "State": "IDLE"}
    assert SlurmNode.from_record(record).gres_type == "a100"
    assert SlurmNode.from_record({**record, "Gres": "gpu:4"}).gres_type is None
    assert SlurmNode.from_record({**record, "Gres": "(null)"}).gres == ""


def two_nodes(python: str = "python3") -> Group:
    return Group(tuple(nodes()[:2]), "debug", python)


def test_srun_asks_one_bounded_task_per_node() -> None:
    program = facts_argv("python3", ["198.18.7.1", "198.18.7.2"], bound_s=60, torch=False)
    argv = srun_argv(two_nodes(), program, bound_s=60, queue_s=30, import_torch=False)
    assert argv[0] == "srun"
    for option in ("--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=n[1-2]",
                   "--immediate=30", "--time=3", "--label", "--partition=debug"):
        assert option in argv
    assert argv[-len(program):] == program


def test_srun_output_cut_into_labelled_pieces_is_put_back_together() -> None:
    out = (OUTPUTS / "srun_label.stdout").read_text()
    assert max(len(line) for line in out.splitlines()) == len("0: ") + 1024  # srun cut them
    found = read_tasks(two_nodes(), 0, out, "", bound_s=60, deadline_s=120)
    assert set(found) == {"n1", "n2"}
    for name, facts in found.items():
        assert not isinstance(facts, Unreachable)
        assert facts["slurm_node"] == name
        assert facts["cpus"]["count"] == facts["cpus"]["usable"] == 4  # Slurm's CPUTot
        assert facts["routes"]["198.18.7.1"]["interface"] == "eth0"


def test_a_failing_task_and_a_refused_allocation_are_reported_per_node() -> None:
    err = (OUTPUTS / "srun_missing_python.stderr").read_text()
    found = read_tasks(two_nodes("/opt/no/python3"), 2, "", err, bound_s=60, deadline_s=120)
    assert found == {
        name: Unreachable(f"/opt/no/python3 -S failed (exit status 2): slurmstepd-{name}: "
                          "error: execve(): /opt/no/python3: No such file or directory")
        for name in ("n1", "n2")}
    busy = (OUTPUTS / "srun_busy.stderr").read_text()
    found = read_tasks(two_nodes(), 1, "", busy, bound_s=60, deadline_s=120)
    assert found["n1"] == Unreachable("srun could not run the probe here: srun: error: Unable "
                                      "to allocate resources: Requested nodes are busy")
    stopped = read_tasks(two_nodes(), None, "", "", bound_s=60, deadline_s=120)
    assert stopped["n2"] == Unreachable("srun gave no answer within 120s (stopped)")


# ------------------------------------------------------------------------------- command line


@pytest.mark.parametrize(("args", "message"), [
    ((), "say which machines to probe"),
    (("--local", "h1"), "probe one kind of machine at once, not HOST/--from and --local"),
    (("--slurm", "--user", "bob"), "SSH settings apply to probing over SSH only: --user"),
    (("--partition", "gpu", "h1"), "--partition and --nodes choose Slurm nodes"),
    (("bob@h1",), "a HOST is a host name or address (got 'bob@h1')"),
    (("h[3-1]",), "not a hostlist"),
])
def test_the_command_line_refuses_what_cannot_be_meant(args: tuple[str, ...],
                                                       message: str) -> None:
    result = cli("inventory", "probe", *args)
    assert result.code == 2
    assert message in result.err


@pytest.mark.process
def test_a_host_that_refuses_the_connection_is_named_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    with socket.socket() as closed:  # a loopback port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    config = tmp_path / "ssh_config"
    config.write_text(f"Host gpu01\n    HostName 127.0.0.1\n    Port {port}\n")
    result = cli("inventory", "probe", "gpu01", "--ssh-config", config, "-o", tmp_path / "x.yaml")
    assert result.code == 1
    assert f"gpu01: unreachable: 127.0.0.1:{port}: Connection refused" in result.out
    assert "nothing to write: no node was probed" in result.out
    assert not (tmp_path / "x.yaml").exists()
