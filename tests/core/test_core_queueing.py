"""The expected start of a waiting job and several hosts' queues as one (core/queueing.py): pure
functions fed the queue answers a host gives (hostside/queueview.py), one of them read from a
real lease book in a temporary folder."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrate.core.queueing import (
    END_SLACK_S,
    disagreements,
    ends_within_s,
    expected_start,
    merge,
    with_expected,
)

pytestmark = pytest.mark.unit

NOW = 1.8e9


def _run(job: str, gpus: list[int], until: float = 0.0, uid: int = 1001) -> dict[str, Any]:
    return {"job_id": job, "user": f"u{uid}", "uid": uid, "gpus": gpus, "slots": 0,
            "since": NOW - 600, "until": until}


def _wait(job: str, place: int, gpus: list[int], ahead: int = 0, uid: int = 1002,
          why: str = "next: every GPU it may use is held") -> dict[str, Any]:
    return {"place": place, "job_id": job, "user": f"u{uid}", "uid": uid, "gpus": gpus,
            "slots": 0, "ahead": ahead, "late": False, "why": why}


def _clock(at: float) -> str:
    return time.strftime("%H:%M", time.localtime(at))


def test_a_next_job_behind_running_jobs_with_time_limits_gets_the_latest_of_their_ends() -> None:
    running = [_run("a", [0, 1], NOW + 3600), _run("b", [2], NOW + 7200), _run("c", [3])]
    got = expected_start(_wait("w", 1, [0, 1, 2]), running, NOW)
    assert got == {"at": NOW + 7200, "line": f"expected start <= {_clock(NOW + 7200)} (when "
                                             "job b reaches its time limit)"}
    # job c (no time limit) holds a GPU this job may not use: it does not count
    assert expected_start(_wait("w", 1, [0, 1]), running, NOW)["at"] == NOW + 3600


def test_the_start_is_unknown_where_a_job_in_the_way_has_no_time_limit() -> None:
    running = [_run("a", [0], NOW + 3600), _run("c", [1])]
    got = expected_start(_wait("w", 1, [0, 1]), running, NOW)
    assert got == {"at": None, "line": "unknown (jobs ahead have no time limit: c)"}


def test_the_start_is_unknown_behind_waiting_jobs_or_a_policy_rule() -> None:
    running = [_run("a", [0], NOW + 3600)]
    assert expected_start(_wait("w", 2, [0], ahead=1), running, NOW)["line"] == \
        "unknown (1 waiting job(s) go before it)"
    late = {**_wait("w", 1, [0]), "late": True}
    assert expected_start(late, running, NOW)["at"] is None
    assert expected_start(_wait("w", 1, [5]), running, NOW)["at"] == NOW  # nothing in its way


def test_a_cpu_job_waits_for_every_slot_holder() -> None:
    cpu = {**_run("s", [], NOW + 60), "slots": 4}
    job = {**_wait("w", 1, []), "slots": 2}
    assert expected_start(job, [cpu, _run("g", [0])], NOW)["at"] == NOW + 60


def test_a_time_limit_gives_a_lease_its_end_with_slack() -> None:
    assert ends_within_s(None) == 0.0
    assert ends_within_s("1:30:00") == 5400 + END_SLACK_S


def _host(name: str, running: list[dict[str, Any]], waiting: list[dict[str, Any]]
          ) -> dict[str, Any]:
    return with_expected({"host": name, "now": NOW, "policy": {"order": "fair"}, "users": [],
                          "running": running, "waiting": waiting, "problems": []})


def test_a_multi_host_job_is_shown_once_with_its_hosts_and_its_latest_start() -> None:
    h1 = _host("h1", [_run("r", [0], NOW + 600)], [_wait("g", 1, [0]), _wait("x", 2, [0], 1)])
    h2 = _host("h2", [_run("r", [0], NOW + 900)], [_wait("g", 1, [0])])
    down = {"host": "h3", "node": "h3", "no_answer": "ssh: connect to host h3: timed out"}
    merged = merge([h1, h2, down])
    assert [j["job_id"] for j in merged["running"]] == ["r"]
    assert merged["running"][0]["hosts"] == ["h1", "h2"]
    assert merged["running"][0]["until"] == NOW + 900
    assert [(j["job_id"], j["hosts"]) for j in merged["waiting"]] == [("g", ["h1", "h2"]),
                                                                      ("x", ["h1"])]
    assert merged["waiting"][0]["places"] == {"h1": 1, "h2": 1}
    assert merged["waiting"][0]["expected"]["at"] == NOW + 900  # when its last host frees
    assert merged["waiting"][1]["expected"]["at"] is None
    assert merged["hosts"][2]["no_answer"].endswith("timed out")
    assert merged["disagree"] == []


def test_hosts_that_order_two_jobs_differently_are_named() -> None:
    h1 = _host("h1", [], [_wait("a", 1, [0]), _wait("b", 2, [0], 1, uid=1003)])
    h2 = _host("h2", [], [_wait("b", 1, [0], uid=1003), _wait("a", 2, [0], 1)])
    h3 = _host("h3", [], [_wait("a", 1, [0])])
    assert disagreements([h1, h2, h3]) == ["h1 puts a@1002 before b@1003; h2 the other way "
                                           "round"]


def test_a_real_books_queue_says_when_the_next_job_starts(tmp_path: Path) -> None:
    from orchestrate.hostside import leases
    from orchestrate.hostside.host import proc_start
    from orchestrate.hostside.leaserecord import Lease, Ticket
    from orchestrate.hostside.queueview import machine_queue

    book = leases.LeaseBook(str(tmp_path / "leases"))
    lease = leases.new_lease("run1", "localhost", [0, 1], 0, None, [os.getpid()]).ending(3600)
    with book.locked():
        book.record(lease)
        book.enqueue(Ticket("wait1", os.geteuid(), time.time() - 5, gpus=[0, 1]).with_holder(
            os.getpid(), proc_start(os.getpid())))
    answer = with_expected(machine_queue(str(tmp_path / "leases")))
    assert Lease.from_json(lease.to_json()).until == lease.since + 3600
    [running] = answer["running"]
    assert running["until"] == pytest.approx(lease.since + 3600)
    [waiting] = answer["waiting"]
    assert waiting["ahead"] == 0 and waiting["expected"]["line"] == (
        f"expected start <= {_clock(lease.since + 3600)} (when job run1 reaches its time limit)")
