"""A rank hung in its exit, named as one: the classifier and the supervisor's map of living ranks.

A rank's sidecar writes a last heartbeat from its exit handler (phase ``exit``); the process
should be gone a few tenths of a second later. One that lives on hangs in the interpreter's
teardown (seen here: a DDP model's reducer destroying gloo's group while holding the GIL,
pytorch/pytorch#56297). The beats below are a real capture's (tests/diagnosis/captures/
laggard.json: 3 gloo ranks, rank 1 behind in its data loading) with the exiting ranks' last beat
edited into the shape a real exit beat has (the exit handler's own frames, no collective in
flight; seen in a run of tests/diagnosis/programs/steps.py's ``teardown`` scenario).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from orchestrate.backends.slurm import monitor
from orchestrate.core.plan.plan import Plan
from orchestrate.diagnosis.hangwatch import handle_owners, living
from tests.support.diagcaptures import load, run_classify
from tests.support.plans import gpu_node, inventory, job, plan

pytestmark = pytest.mark.unit

HANDLER = "/RUN/sidecar/_orchestrate_rank/sidecar.py"


def exited(data: dict[str, Any], *ranks: int) -> dict[str, Any]:
    """The capture with ``ranks``' last beat made the one their sidecar writes at the exit;
    past it a rank answers no dump request."""
    out = copy.deepcopy(data)
    for rank in ranks:
        out["dumps"][rank] = None
        beat = out["heartbeats"][rank]
        beat.update(phase="exit", stack=[[HANDLER, 213, "heartbeat"], [HANDLER, 200, "_at_exit"]],
                    user_stack=[])
        for group in beat["pgs"]:
            group["completed"] = group["enqueued"]
            for key in ("op", "op_seq", "op_since", "op_state", "sizes"):
                group.pop(key, None)
    return out


def test_the_one_rank_alive_after_its_exit_is_named_with_its_pid_and_the_others_exited() -> None:
    data = exited(load("laggard"), 0, 1, 2)
    pid = data["heartbeats"][1]["pid"]
    diagnosis = run_classify(data, alive={0: False, 1: True, 2: False})
    assert (diagnosis.kind, diagnosis.ranks, diagnosis.nodes) == ("teardown", (1,), ("node-a",))
    assert diagnosis.summary.startswith(
        f"rank 1 (node node-a, pid {pid}) ended its program "), diagnosis.summary
    assert " s ago but has not exited: it hangs in the interpreter's teardown (" in (
        diagnosis.summary)
    assert diagnosis.summary.endswith("docs/hangs.md); ranks 0,2 have exited")


def test_without_word_of_the_processes_every_rank_at_its_exit_is_named() -> None:
    """The Slurm batch host sees no other node's processes: all ranks ended their programs and
    the step still runs, so one of them hangs; which one it cannot tell."""
    data = exited(load("laggard"), 0, 1, 2)
    diagnosis = run_classify(data)
    assert (diagnosis.kind, diagnosis.ranks) == ("teardown", (0, 1, 2))
    assert diagnosis.nodes == ("node-a", "node-b")
    assert diagnosis.summary.startswith("ranks 0-2 (nodes node-a, node-b) ended their programs ")
    assert ", but not every process has exited: one hangs in the interpreter's teardown" in (
        diagnosis.summary)


def test_a_rank_that_ended_its_program_early_is_the_laggard_and_no_frame_of_its_handler() -> None:
    """Rank 1 ended its program while ranks 0 and 2 wait for it in all_reduce #15 (NCCL hangs
    there; gloo sees the closed peer): its place is its exit, not the sidecar's own frame."""
    data = exited(load("laggard"), 1)
    diagnosis = run_classify(data, alive={0: True, 1: False, 2: True})
    assert (diagnosis.kind, diagnosis.ranks) == ("laggard", (1,))
    assert diagnosis.summary.startswith(
        "rank 1 (node node-a) has not reached collective #15: it is in its exit (its program "
        "had ended); ranks 0,2 wait in all_reduce #15 for "), diagnosis.summary
    assert "sidecar.py" not in diagnosis.summary


def test_a_rank_at_its_exit_beside_ranks_still_in_their_program_is_not_the_one_named() -> None:
    data = exited(load("laggard"), 0)
    diagnosis = run_classify(data, alive={0: True, 1: True, 2: True})
    assert diagnosis.kind != "teardown"
    assert 0 not in diagnosis.ranks


def rank_owners(planned: Plan) -> dict[int, int]:
    """The handles the supervisor's watch maps a plan's ranks to (run/watcher.py)."""
    return handle_owners({r.rank: r.node for r in planned.ranks}, planned.per_node)


def test_every_planned_rank_lives_while_its_handle_runs_one_per_node_under_a_launcher() -> None:
    two = inventory(gpu_node("a", 3, address="198.18.0.1"), gpu_node("b", 2, address="198.18.0.2"))
    workers = plan(job(launcher="per_node", resources={"nodes": 2, "gpus_per_node": "all"}), two)
    owners = rank_owners(workers)
    assert owners == {0: 0, 1: 0, 2: 0, 3: 3, 4: 3}
    assert living(owners, frozenset({3})) == {0: False, 1: False, 2: False, 3: True, 4: True}
    ranks = plan(job(resources={"nodes": 2, "gpus_per_node": "all"}), two)
    assert living(rank_owners(ranks), frozenset({1, 4})) == {
        0: False, 1: True, 2: False, 3: False, 4: True}


def test_on_slurm_a_rank_lives_until_its_task_records_its_end(tmp_path: Path) -> None:
    """The batch host's watch reads the ends each rank's shell writes (``status at_us host``,
    what ``decide`` reads after the step); under a launcher a node's task is its first rank."""
    hosts = {0: "node-a", 1: "node-a", 2: "node-b"}
    per_rank, per_node = handle_owners(hosts, per_node=False), handle_owners(hosts, per_node=True)
    (tmp_path / "rank-0").write_text("0 1796516219791000 node-a\n")
    assert monitor.tasks_living(str(tmp_path), per_rank) == {0: False, 1: True, 2: True}
    assert monitor.tasks_living(str(tmp_path), per_node) == {0: False, 1: False, 2: True}
    (tmp_path / "rank-2").write_text("garbled")  # being written: not an end yet
    assert monitor.tasks_living(str(tmp_path), per_node)[2] is True
    assert monitor.tasks_living(None, per_rank) is None
