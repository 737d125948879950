"""The doctor's parts on their own: the roll call on real loopback sockets, the marked lines,
the derived job, node facts from the real gatherer, findings from reports, the page.

Reports (the ``node``, ``result`` and ``rank`` payloads) are built here in the shapes the rank
program prints (orchestrate/doctor/checkup/leader.py, orchestrate/doctor/checkup/program.py); the
SSH and local tests run the real thing end to end.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrate.core.errors import Problem
from orchestrate.core.layout import OWN_REACH_CHECK
from orchestrate.core.spec.inventory import Inventory, InventorySpec, Node, resolve_inventory
from orchestrate.core.spec.job import JobSpec
from orchestrate.doctor import findings, grading
from orchestrate.doctor import page as doctorpage
from orchestrate.doctor import run as doctor
from orchestrate.doctor.checkup import rollcall, transcript
from orchestrate.doctor.checkup.result import CheckupResult, PairMatrix, SizeTiming, Sweep
from orchestrate.doctor.grading import JobShape, PlannedNode
from orchestrate.doctor.static_tier import from_host
from orchestrate.hostside import hostfacts
from orchestrate.run.prepare import Loaded, plan_job
from tests.support.probemachine import machine
from tests.support.ranks import free_port

pytestmark = pytest.mark.unit


def _inventory(nodes: list[dict[str, Any]], **defaults: Any) -> Inventory:
    return resolve_inventory(InventorySpec.model_validate(
        {"name": "lab", "defaults": defaults, "nodes": nodes}))


def _shape(names: list[str], **network: Any) -> JobShape:
    nodes = tuple(PlannedNode(n, Node(name=n, address=f"10.0.0.{i + 1}"), nproc=1,
                              interface="eth0") for i, n in enumerate(names))
    return JobShape(nodes, "gloo", "10.0.0.1", 29400)


# -- the roll call, on real sockets ---------------------------------------------------------------



@pytest.mark.timing
@pytest.mark.process
def test_roll_call_hands_every_leader_the_directory_and_node_0s_clock() -> None:
    port = free_port()
    answers: dict[str, dict[str, Any]] = {}

    def leader(name: str, delay: float) -> None:
        time.sleep(delay)  # node 0 is not listening yet for the first ones
        answers[name] = rollcall.answer("127.0.0.1", port, {"node": name, "pair_port": 1000},
                                        window_s=10)

    threads = [threading.Thread(target=leader, args=(n, d))
               for n, d in (("b", 0.0), ("c", 0.3), ("a", 1.2))]
    for t in threads:
        t.start()
    time.sleep(0.6)
    master = rollcall.RollCall(port)
    began = time.monotonic()
    served = master.serve(expect=3, seconds=10)
    took = time.monotonic() - began
    for t in threads:
        t.join(5)
    assert sorted(served["heard"]) == ["a", "b", "c"] and took < 3
    for answer in answers.values():
        assert answer["outcome"] == "ok", answer
        assert sorted(d["node"] for d in answer["directory"]) == ["a", "b", "c"]
        assert all(d["address"] == "127.0.0.1" for d in answer["directory"])
        assert abs(answer["clock_offset_s"]) < 0.5  # one clock here
    assert answers["b"]["tries"] > 1  # refused until node 0 listened, then retried


@pytest.mark.timing
@pytest.mark.process
def test_roll_call_closes_a_store_client_and_ends_at_its_window() -> None:
    port = free_port()
    master = rollcall.RollCall(port)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(master.serve(2, 1.5)))
    thread.start()
    client = socket.create_connection(("127.0.0.1", port), timeout=2)
    client.sendall(b"\x00\xce\xf7\x85<binary store handshake")  # what a TCPStore client sends
    client.settimeout(2)
    assert client.recv(10) == b""  # closed at once
    one = rollcall.answer("127.0.0.1", port, {"node": "a"}, window_s=5)
    thread.join(5)
    assert result["heard"] == ["a"] and result["silent"] == 1
    assert 1.4 < result["seconds"] < 3
    assert one["outcome"] == "ok" and [d["node"] for d in one["directory"]] == ["a"]
    # The port is released: the smoke tier's store can bind it now.
    rollcall.RollCall(port).sock.close()


def _say(port: int, line: bytes) -> bytes:
    """Send one line to the roll call as a stranger would; what comes back before it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        sock.sendall(line)
        sock.settimeout(3)
        return sock.recv(100)


@pytest.mark.process
def test_malformed_and_foreign_hellos_are_refused_and_the_planned_nodes_still_heard() -> None:
    """#25 item 6: one ``orchestrate-rollcall null`` line used to kill node 0's roll call
    (TypeError), and two hellos from names outside the plan used to fill it: the doctor then
    failed a healthy cluster and blamed the first node."""
    port = free_port()
    master = rollcall.RollCall(port)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(master.serve(2, 8, ("a", "b"))))
    thread.start()
    for line in (b"orchestrate-rollcall null\n", b"orchestrate-rollcall [1, 2]\n",
                 b'orchestrate-rollcall {"node": "intruder"}\n',
                 b'orchestrate-rollcall {"node": "mallory", "group_rank": 0}\n',
                 b'orchestrate-rollcall {"node": "b", "group_rank": 7}\n'):
        assert _say(port, line) == b""  # closed without the directory
    answers: dict[str, dict[str, Any]] = {}
    leaders = [threading.Thread(target=lambda n=name, g=group: answers.update(
        {n: rollcall.answer("127.0.0.1", port, {"node": n, "group_rank": g}, window_s=8)}))
        for name, group in (("a", 0), ("b", 1))]
    for leader in leaders:
        leader.start()
    for leader in leaders:
        leader.join(10)
    thread.join(10)
    assert sorted(result["heard"]) == ["a", "b"]
    assert len(result["refused"]) == 5 and any("intruder" in r for r in result["refused"])
    for name in ("a", "b"):
        assert answers[name]["outcome"] == "ok", answers[name]
        assert sorted(d["node"] for d in answers[name]["directory"]) == ["a", "b"]


@pytest.mark.process
def test_a_node_says_hello_once() -> None:
    port = free_port()
    master = rollcall.RollCall(port)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(master.serve(2, 3, ("a", "b"))))
    thread.start()
    first = threading.Thread(target=lambda: rollcall.answer(
        "127.0.0.1", port, {"node": "a", "group_rank": 0}, window_s=5))
    first.start()
    time.sleep(0.5)
    assert _say(port, b'orchestrate-rollcall {"node": "a", "group_rank": 0}\n') == b""
    thread.join(6)
    first.join(6)
    assert result["heard"] == ["a"]
    assert ["already said hello" in r for r in result["refused"]] == [True]


@pytest.mark.timing
@pytest.mark.process
def test_a_leader_that_finds_no_roll_call_reports_refused_within_its_window() -> None:
    began = time.monotonic()
    answer = rollcall.answer("127.0.0.1", free_port(), {"node": "a"}, window_s=1.2)
    assert answer["outcome"] == "refused" and answer["directory"] is None
    assert answer["tries"] >= 2 and "tries over" in answer["detail"]
    assert time.monotonic() - began < 2.5


@pytest.mark.process
def test_a_taken_master_port_is_an_error_at_once() -> None:
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        with pytest.raises(OSError):
            rollcall.RollCall(holder.getsockname()[1])


# -- marked lines ---------------------------------------------------------------------------------


def test_marked_lines_are_found_in_rank_logs_merged_logs_and_pty_output() -> None:
    node = {"kind": "node", "node": "h1", "facts": {"a": [1, 2]}}
    result = {"kind": "result", "ok": True}
    text = "\n".join([
        "checkup: starting",
        transcript.line(node) + "\r",  # a pty's line ending
        "[h2:3] " + transcript.line(result),  # the merged log's prefix
        transcript.line({"kind": "rank"})[:30],  # cut short by a kill
        "orchestrate-checkup not json",
        transcript.line({"no": "kind"}),
    ])
    assert transcript.read(text) == [node, result]


# -- the derived job ------------------------------------------------------------------------------


def _loaded(backend: str, tmp_path: Path, **job: Any) -> Loaded:
    inventory_spec = InventorySpec.model_validate({
        "name": "lab", "defaults": {"network": {"interface": "eth0", "gbps": 25}},
        "nodes": [{"name": f"n{i}", "address": f"10.0.0.{i}", "slots": 4} for i in (1, 2, 3)]})
    inv = resolve_inventory(inventory_spec)
    spec = JobSpec.model_validate({
        "name": "train", "backend": backend, "inventory": "inv.yaml",
        "resources": {"nodes": 2, "gpus_per_node": 2, "node_names": ["n3", "n1"]},
        "command": ["python", "train.py"], "env": {"FOO": "1"},
        "restart": {"max": 5, "on": ["failure"]}, **job})
    return Loaded(source="job.yaml", overrides=(), job=spec, inventory=inv,
                  inventory_spec=inventory_spec,
                  inventory_source="inv.yaml", workdir=tmp_path, runs=tmp_path / "runs",
                  templates_dir=None, param_count=None)


@pytest.mark.parametrize("backend", ["ssh", "slurm"])
def test_the_doctor_job_is_the_job_with_the_checkup_as_its_program(
        backend: str, tmp_path: Path) -> None:
    loaded = _loaded(backend, tmp_path)
    original = plan_job(loaded, "train-1").plan
    settings = doctor.Settings(tier="smoke", timeout_s=10, window_s=8)
    derived = doctor.derive(loaded, original, settings)
    plan = plan_job(derived, doctor.doctor_job_id("train-1")).plan
    # Same nodes, ranks, GPUs/slots, interfaces and environment as the job...
    assert [(n.name, n.nproc, n.env) for n in plan.nodes] == [
        (n.name, n.nproc, n.env) for n in original.nodes]
    # (plus the mark that its connect tier checks the master's reach itself)
    assert plan.env[OWN_REACH_CHECK] == "1" and OWN_REACH_CHECK not in original.env
    assert {k: v for k, v in plan.env.items() if "JOB_ID" not in k and "RUN" not in k
            and k not in ("MASTER_PORT", "TORCHELASTIC_RUN_ID", OWN_REACH_CHECK)} == {
        k: v for k, v in original.env.items() if "JOB_ID" not in k and "RUN" not in k
        and k not in ("MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    # ...running the checkup once, within a time limit every backend enforces.
    command = list(plan.nodes[0].command)
    assert command[1:3] == ["-m", "orchestrate.doctor.checkup"]
    assert command[command.index("--tier") + 1] == "static,health,connect,smoke"
    assert command[command.index("--nodes") + 1] == "2"
    assert ("--node-names" in command) == (backend != "slurm")
    if backend != "slurm":
        assert command[command.index("--node-names") + 1] == "n3,n1"
    assert plan.restart.max == 0
    assert plan.time_limit is not None and int(plan.time_limit) * 60 >= doctor.bound_s(
        original, settings)
    assert float(command[command.index("--deadline-s") + 1]) >= doctor.checkup_deadline_s(
        original, settings)
    # What a supervisor process reads back validates (the ORCHESTRATE_ env names stay out).
    assert Loaded.from_json(json.loads(json.dumps(derived.to_json()))).job == derived.job


def test_tiers_include_the_ones_before() -> None:
    assert findings.tiers_up_to("static") == ("static",)
    assert findings.tiers_up_to("smoke") == ("static", "health", "connect", "smoke")
    assert findings.tiers_up_to("all") == findings.tiers_up_to("bandwidth")
    assert len(doctor.doctor_job_id("x" * 64)) <= 64


# -- node facts from the real gatherer ------------------------------------------------------------


@pytest.mark.process
def test_node_facts_from_a_gathered_h100_box(tmp_path: Path) -> None:
    with machine(tmp_path, "h100-nvswitch"):
        raw = hostfacts.gather(peers=["127.0.0.1"], torch=False)
    facts = from_host(raw, interface="eno1", master_addr="127.0.0.1", clock_offset_s=0.2)
    assert facts.gpus is not None and len(facts.gpus) == 8
    assert {g.model for g in facts.gpus} == {"H100-80GB"}
    assert [g.cuda_index for g in facts.gpus] == list(range(8))
    assert facts.versions["driver"] and facts.versions["python"]
    assert facts.interface is not None
    assert facts.interface.exists and facts.interface.up is True
    assert facts.interface.speed_mbps == 1000
    assert facts.interface.routes_to_master is False and facts.interface.route_dev == "lo"
    assert "ib0" in facts.interface.available and "lo" not in facts.interface.available
    assert facts.clock_offset_s == 0.2
    missing = from_host(raw, interface="=eth7", master_addr="127.0.0.1")
    assert missing.interface is not None and missing.interface.name == "eth7"
    assert not missing.interface.exists


# -- findings -------------------------------------------------------------------------------------


def _node_report(name: str, group: int, *, directory: bool = True, facts: bool = True,
                 pairs: dict[str, str] | None = None) -> dict[str, Any]:
    report: dict[str, Any] = {
        "kind": "node", "node": name, "group_rank": group, "rank": group,
        "master_addr": "10.0.0.1", "master_port": 29400, "interface": "eth0",
        "rollcall": {"host": "10.0.0.1", "port": 29400, "outcome": "ok", "seconds": 0.01,
                     "tries": 1, "detail": "",
                     "clock_offset_s": 0.002 if directory else None},
        "directory": [{"node": name}] if directory else [],
        "pairs": [{"target": t, "host": "x", "port": 40000, "outcome": o, "seconds": 0.01,
                   "detail": ""} for t, o in (pairs or {}).items()],
        "pair_listener": {"port": 40000, "heard": []},
    }
    if facts:
        nics = [{"name": "eth0", "operstate": "up", "speed_mbps": 25000, "mtu": 1500,
                 "type": 1, "physical": True, "bridge": False, "addresses": ["10.0.0.9"]}]
        report["facts"] = {
            "version": 1, "hostname": name, "nvidia_smi": {"status": "missing"},
            "net": {"interfaces": nics, "infiniband": []},
            "routes": {"10.0.0.1": {"interface": "eth0", "ip": "10.0.0.1"}},
            "python": {"version": "3.11.7"}, "torch": {"version": "2.13.0+cpu"},
            "shm_bytes": 8 << 30, "memlock": {"soft": "unlimited", "hard": "unlimited"},
        }
    return report


def test_a_node_that_never_reported_fails_static_and_connect_naming_it() -> None:
    shape = _shape(["a", "b", "c"])
    reports = [_node_report("a", 0, pairs={"b": "ok"}), _node_report("b", 1, pairs={"a": "ok"})]
    end = findings.JobEnd("FAILED", reason="lost contact with c", failed_rank=2, failed_node="c")
    checks, _ = findings.assess(shape, ("static", "connect"), reports, end)
    failed = [(c.tier, c.name, c.nodes) for c in checks if c.status == "fail"]
    assert failed == [("static", "facts", ("c",)), ("connect", "node report", ("c",))]
    assert "lost contact with c" in checks[0].detail
    assert all(c.status == "pass" for c in checks if "c" not in c.nodes)


def test_a_node_without_the_directory_is_named_for_its_untested_pairs() -> None:
    shape = _shape(["a", "b"])
    reports = [_node_report("a", 0), _node_report("b", 1, directory=False)]
    reports[1]["rollcall"].update(outcome="timeout", detail="no answer within 3 s")
    checks, _ = findings.assess(shape, ("connect",), reports, findings.JobEnd("COMPLETED"))
    failed = {c.name: c for c in checks if c.status == "fail"}
    assert set(failed) == {"master port", "pairs with b"}
    assert all(c.nodes == ("b",) for c in failed.values())
    assert "b cannot connect to the master a:29400: timeout" in failed["master port"].detail


def test_a_refused_launch_names_the_host_in_the_backends_words() -> None:
    shape = _shape(["h1", "h2", "h10"])
    problems = (Problem("h2 (10.0.0.2): ssh: unreachable: no route", field="preflight",
                        hint="check the address"),
                Problem("h10 (10.0.0.10): torch: import torch failed", field="preflight"))
    checks, section = findings.assess(shape, ("static", "connect", "smoke"), [],
                                      findings.JobEnd("REFUSED", reason="ssh backend",
                                                      refused=problems))
    assert [(c.name, c.nodes, c.status) for c in checks] == [
        ("launch", ("h2",), "fail"), ("launch", ("h10",), "fail")]
    assert checks[0].hint == "check the address" and section == {}


def test_no_result_names_the_backends_first_failure() -> None:
    shape = _shape(["a", "b"])
    end = findings.JobEnd("FAILED", reason="rank 1 exited 1", failed_rank=1, failed_node="b",
                          last_lines=("ModuleNotFoundError: No module named 'orchestrate'",))
    checks, _ = findings.assess(shape, ("smoke",), [], end)
    assert [(c.name, c.nodes, c.status) for c in checks] == [
        ("checkup result", ("b",), "fail")]
    assert "No module named 'orchestrate'" in checks[0].detail


def test_lone_rank_failures_are_merged_and_smoke_points_at_the_static_culprit() -> None:
    shape = _shape(["a", "b"])
    bad = _node_report("b", 1)
    bad["interface"] = "eth9"
    lone = [{"kind": "rank", "rank": r, "tiers": ["smoke"], "world_size": 2, "nodes": [n],
             "failure": {"tier": "smoke", "step": "join", "detail": f"rank {r} ({n}) failed",
                         "ranks": [r], "nodes": [n], "per_rank": {str(r): "timeout"}}}
            for r, n in ((1, "b"), (0, "a"))]
    checks, _ = findings.assess(shape, ("static", "smoke"), [_node_report("a", 0), bad, *lone],
                                findings.JobEnd("FAILED"))
    smoke = [c for c in checks if c.tier == "smoke"]
    assert [(c.name, c.nodes) for c in smoke] == [("join", ("b", "a"))]
    assert smoke[0].hint.startswith("the static/connect tiers failed on b: fix that first")
    assert [c.nodes for c in checks if c.tier == "static" and c.status == "fail"] == [("b",)]


def test_a_slurm_job_is_graded_on_the_nodes_slurm_gave_it() -> None:
    inv = _inventory([{"name": n, "address": n, "slots": 2} for n in ("c1", "c2", "c3")])
    shape = _shape(["c1", "c2"])
    reports = [_node_report("c3", 0), _node_report("c1", 1)]
    ran = findings.ran_on(shape, inv, reports)
    assert ran.names == ("c3", "c1") and ran.nodes[0].node.name == "c3"
    assert findings.ran_on(shape, inv, [_node_report("node 0", 0)]) == shape


def _bandwidth_result() -> CheckupResult:
    sizes = tuple(SizeTiming(b, 5, b / 0.5e9, b / 0.45e9, 4) for b in (1 << 20, 16 << 20))
    return CheckupResult(
        tiers=("smoke", "bandwidth"), backend="gloo", world_size=4, nodes=("a", "b"),
        ranks=tuple({"rank": r, "node": "ab"[r // 2], "group_rank": r // 2} for r in range(4)),
        elapsed_s=3.0, steps_s={"join": 0.1}, world=Sweep(4, 2, sizes),
        intra={"a": Sweep(2, 1, sizes)},
        pairs=PairMatrix(("a", "b"), 16 << 20, ((None, 1.1), (1.2, None))))


def test_the_document_matches_what_the_run_report_draws() -> None:
    payload = {**_bandwidth_result().to_json(), "kind": "result"}
    checks, section = findings.assess(_shape(["a", "b"]), ("smoke", "bandwidth"), [payload],
                                      findings.JobEnd("COMPLETED"))
    doc = grading.document(checks, section)
    rows = doc["bandwidth"]["allreduce"]
    assert {r["backend"] for r in rows} == {"all 4 ranks (gloo)", "inside a (gloo)"}
    assert all(set(r) == {"size_bytes", "busbw_GBps", "algbw_GBps", "backend"} for r in rows)
    assert doc["bandwidth"]["pairs"]["nodes"] == ["a", "b"]
    assert doc["bandwidth"]["pairs"]["GBps"] == [[None, 1.1], [1.2, None]]
    assert doc["verdict"] == "pass"


def test_the_page_draws_busbw_against_its_band_and_the_matrix() -> None:
    section = findings.report_bandwidth({
        "backend": "nccl",
        "all_reduce": {"ranks": 8, "nodes": 1, "sizes": [
            {"bytes": 1 << 20, "busbw_GBps": 20.0, "algbw_GBps": 11.4},
            {"bytes": 1 << 30, "busbw_GBps": 180.0, "algbw_GBps": 102.9}],
            "expected": {"floor_GBps": 228.0, "warn_below_GBps": 114.0,
                         "fail_below_GBps": 45.6, "basis": "Azure NHC"}},
        "pairs": {"nodes": ["a", "b<"], "bytes": 1 << 28, "GBps": [[None, 2.0], [0.4, None]],
                  "blamed_nodes": [], "blamed_links": [["a", "b<"]]}})
    checks = [grading.Check("bandwidth", "link a <-> b<", ("a", "b<"), "fail", "slow <link>")]
    page = doctorpage.render(grading.document(checks, section), {"job_id": "j-doctor-1"})
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert 'id="busbw"' in page and 'class="band"' in page and "floor 228 GB/s" in page
    assert 'id="pairs"' in page and 'data-row="b&lt;"' in page
    assert "slow &lt;link&gt;" in page and "slow link(s): a &lt;-&gt; b&lt;" in page
    assert 'class="verdict fail"' in page


def test_nodes_stopped_by_another_nodes_failure_are_not_blamed() -> None:
    """One host's python cannot import orchestrate: its rank fails at once, the job is stopped
    before the others report. Only that host fails; the others are 'not checked', naming it."""
    shape = _shape(["a", "b", "c"])
    end = findings.JobEnd("FAILED", reason="rank 2 on c exited 1", failed_rank=2,
                          failed_node="c",
                          last_lines=("ModuleNotFoundError: No module named 'orchestrate'",))
    checks, _ = findings.assess(shape, ("static", "connect"), [], end)
    failed = [(c.tier, c.name, c.nodes) for c in checks if c.status == "fail"]
    assert failed == [("static", "facts", ("c",)), ("connect", "node report", ("c",))]
    assert "No module named 'orchestrate'" in checks[-1].detail
    warned = {c.nodes: c.detail for c in checks if c.status == "warn"}
    assert warned == {(n,): "not checked: the doctor's job stopped when rank 2 on c failed first"
                      for n in ("a", "b")}
    # A node that did report is graded as ever.
    checks, _ = findings.assess(shape, ("static",), [_node_report("a", 0)], end)
    assert {c.nodes for c in checks if c.status == "fail"} == {("c",)}
    assert any(c.nodes == ("a",) and c.status == "pass" for c in checks)
