"""Another user's process on a running job's GPUs (issue #32, class 4): what the job's owner is
told, from what the watchers (the local supervisor's thread, each SSH host's agent) report --
each process once in the job's log, the current list for ``status``, and the attempt's ending,
so a job whose GPUs were shared never ends COMPLETED without saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrate.backends.sharing import ForeignWatch
from orchestrate.backends.ssh.wire import ForeignUse

pytestmark = pytest.mark.unit

BEN = "GPU 3 of your job is also used by pid 4242 (ben, python train.py, 12.0 GB)"
CAROL = "GPU 2 of your job is also used by pid 77 (carol, jupyter, 3.0 GB)"


def test_each_process_is_logged_once_listed_while_there_and_named_in_the_ending(
        tmp_path: Path) -> None:
    logged: list[str] = []
    listed = tmp_path / "foreign-gpu-use.json"
    watch = ForeignWatch(listed, logged.append)
    watch.update("h1", {4242: BEN})
    watch.update("h1", {4242: BEN.replace("12.0", "13.5")})  # the same process, more memory
    watch.update("h2", {77: CAROL})
    assert logged == [f"on h1: {BEN}", f"on h2: {CAROL}"]
    assert json.loads(listed.read_text()) == [f"on h1: {BEN.replace('12.0', '13.5')}",
                                              f"on h2: {CAROL}"]
    watch.update("h1", {})  # ben's process ended: status no longer lists it
    assert json.loads(listed.read_text()) == [f"on h2: {CAROL}"]
    ending = watch.ending()
    assert ending is not None and ending.startswith("another user's process used its GPUs too")
    assert "GPU 3 of your job was also used by pid 4242 (ben, python train.py, 13.5 GB)" \
        in ending and "pid 77 (carol" in ending
    assert watch.ending() is None  # the next attempt starts afresh


def test_a_job_nobody_shared_ends_without_a_word(tmp_path: Path) -> None:
    watch = ForeignWatch(tmp_path / "foreign-gpu-use.json", print)
    watch.update("", {})
    assert watch.ending() is None and not (tmp_path / "foreign-gpu-use.json").exists()


def test_the_agents_report_reads_back_and_a_bad_one_is_refused() -> None:
    said = ForeignUse({"4242": BEN})
    assert ForeignUse.from_json(json.loads(json.dumps(said.to_json()))) == said
    with pytest.raises(ValueError, match="uses must be dict"):
        ForeignUse.from_json({"uses": [BEN]})
