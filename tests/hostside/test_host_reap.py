"""The end of a job here asks podman and docker for its containers only when it may have some.

``reap`` (the end of every local attempt, the watchdog, an SSH agent's hangup) removed the job's
containers by asking each runtime installed, even for a job that runs in none: 0.15-0.45 s at
the end of every local job on the development machine, between the last rank's exit and
``submit --follow`` returning. Real runtimes are stood in for by programs on PATH that write
down that they were asked (the job here has no process to stop).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrate.hostside.host import reap


@pytest.fixture
def asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A podman and a docker on PATH that append their name and arguments to a file."""
    record = tmp_path / "asked"
    for runtime in ("podman", "docker"):
        program = tmp_path / runtime
        program.write_text(f'#!/bin/sh\necho "{runtime} $*" >> {record}\n')
        program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    return record


@pytest.mark.unit
def test_a_job_in_no_container_asks_no_runtime(asked: Path) -> None:
    """The unit tier refuses any process start: none is made, and none was recorded."""
    assert reap("job-without-box", 0.0, containers=False) == {"found": 0, "killed": 0}
    assert not asked.exists()


@pytest.mark.process
def test_a_job_that_may_have_containers_asks_every_runtime_by_its_label(asked: Path) -> None:
    reap("job-in-box", 0.0)
    lines = asked.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["podman", "docker"]
    assert all("--filter label=orchestrate.job=job-in-box" in line for line in lines)
