"""The world check (orchestrate/diagnosis/world.py): a process group that is not the plan's is
named in one sentence, and a world that is the plan's never is. Pure: records in, diagnosis out.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from pathlib import Path

import pytest

from orchestrate.diagnosis.diagfiles import DiagFiles, Joined
from orchestrate.diagnosis.joinwatch import record
from orchestrate.diagnosis.world import wrong_world

pytestmark = pytest.mark.unit


def _j(rank: int, world: int, host: str = "h1", pid: int = 100, env_rank: int | None = None,
       t: float = 1.0, heartbeats: bool = True) -> Joined:
    return Joined(pid, host, rank, world, env_rank, t, heartbeats)


def test_the_plans_world_is_never_named() -> None:
    joined = [_j(0, 4, "h1", 1, 0), _j(1, 4, "h1", 2, 1), _j(2, 4, "h2", 1, 2),
              _j(3, 4, "h2", 2, 3)]
    assert wrong_world(joined, 4, "ranks", 5.0) is None
    assert wrong_world([], 4, "ranks", 5.0) is None
    # per_node workers have no RANK of their own: still the plan's world.
    assert wrong_world([_j(r, 4, pid=r) for r in range(4)], 4, "per_node", 5.0) is None


def test_a_world_of_another_size_is_named_with_the_rank_host_and_hint() -> None:
    found = wrong_world([_j(0, 4, "h1", 1, 0), _j(0, 1, "h2", 7, 1, t=2.0)], 4, "ranks", 9.0)
    assert found is not None and found.kind == "wrong_world"
    assert found.summary.startswith("rank 1 on h2 joined a world of 1, the plan has 4: the "
                                    "program builds its own world (mp.spawn or torchrun inside "
                                    "a `ranks` job?)"), found.summary
    assert found.nodes == ("h2",) and found.ranks == (1,) and found.at == 9.0
    # Without a RANK of its own (a per_node worker), the rank it joined as.
    found = wrong_world([_j(3, 2, "h2", 7)], 4, "per_node", 9.0)
    assert found is not None and found.summary.startswith("rank 3 on h2 joined a world of 2")


def test_two_worlds_of_the_plans_size_are_named_by_the_rank_joined_twice() -> None:
    """Two hosts x 1 rank, each running the notes' mp.spawn with world 2 on localhost: every
    world has the plan's size, but rank 0 and 1 are each joined twice."""
    joined = [_j(0, 2, "h1", 1), _j(1, 2, "h1", 2), _j(0, 2, "h2", 3), _j(1, 2, "h2", 4)]
    found = wrong_world(joined, 2, "per_node", 1.0)
    assert found is not None and found.ranks == (0, 1) and found.nodes == ("h1", "h2")
    assert "joined more than once (h1 pid 1, h1 pid 2, h2 pid 3, h2 pid 4)" in found.summary
    assert "WORLD_SIZE, and rank ORCHESTRATE_FIRST_RANK + i" in found.summary


def test_a_rank_that_joins_as_another_rank_is_named_under_ranks_only() -> None:
    swapped = [_j(1, 2, "h1", 1, env_rank=0), _j(0, 2, "h1", 2, env_rank=1)]
    found = wrong_world(swapped, 2, "ranks", 1.0)
    assert found is not None
    assert found.summary.startswith("rank 1 on h1 joined as rank 0: its "
                                    "init_process_group(rank=...) is not the RANK"), found.summary
    assert wrong_world(swapped, 2, "torchrun", 1.0) is None


def test_a_rank_that_re_initialises_a_world_of_its_own_is_named_with_both_worlds() -> None:
    """Join the plan's world, destroy it, init again alone: the process's second record."""
    joined = [_j(0, 2, "h1", 1, 0, t=1.0), _j(1, 2, "h1", 2, 1, t=1.0),
              _j(0, 1, "h1", 2, 1, t=2.0)]
    found = wrong_world(joined, 2, "ranks", 3.0)
    assert found is not None and found.ranks == (1,) and found.nodes == ("h1",)
    assert found.summary.startswith(
        "rank 1 on h1 joined the plan's world of 2 as rank 1, then re-initialised a world of 1 "
        "as rank 0, the plan has 2: "), found.summary


def test_every_rank_that_formed_a_world_of_its_own_is_named() -> None:
    """Both ranks each formed a world of 1 (and it may have lived under a second)."""
    joined = [_j(0, 1, "h1", 1, 0, t=1.0), _j(0, 1, "h2", 2, 1, t=1.5)]
    found = wrong_world(joined, 2, "ranks", 3.0)
    assert found is not None and found.ranks == (0, 1) and found.nodes == ("h1", "h2")
    assert found.summary.startswith("rank 0 on h1 joined a world of 1, the plan has 2 (rank 1 "
                                    "formed a world of 1 too): "), found.summary


def test_a_join_recorded_by_two_threads_at_once_is_always_one_whole_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker under per_node: the init_process_group wrapper and its just-started sidecar record
    # the same join at once. With one temporary file per process the shorter record landed over
    # the longer one's tail ('..."heartbeats": true}}') and the world check's reader failed.
    monkeypatch.setattr(time, "time", lambda: random.choice([1.5, 1796447840.643195, 12.25]))
    path = DiagFiles(tmp_path).joined_by(1, socket.gethostname(), os.getpid(), 1)
    bad: list[str] = []
    done = threading.Event()

    def writer(heartbeats: bool) -> None:
        for _ in range(400):
            record(str(tmp_path), 0, 2, heartbeats=heartbeats)

    def reader() -> None:
        while not done.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
            except ValueError:
                bad.append(text)

    threads = [threading.Thread(target=writer, args=(flag,)) for flag in (True, False, True)]
    look = threading.Thread(target=reader)
    look.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    look.join()
    assert bad == []
    assert Joined.from_json(json.loads(path.read_text())) is not None
    assert list(tmp_path.rglob("*.tmp")) == []
