"""The SSH agent answers ``progress`` on its serving channel (issue #37): the supervisor reads
how far training got before the first attempt on rank 0's channel, already logged in and idle,
where the one-shot ``progress`` mode started a shell and an interpreter on the host first
(0.15-0.3 s before every launch on the 2-core test hosts). The agent runs as an SSH host runs
it (``python -S -c SOURCE serve``), requests on its standard input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrate.backends.ssh.channels import agent_source
from orchestrate.backends.ssh.wire import TrainingProgress
from orchestrate.hostside.shipping import compact
from tests.support.agentreplies import agent_replies

pytestmark = pytest.mark.process


def _serve(*requests: TrainingProgress) -> list[tuple[str, object]]:
    proc = subprocess.run(
        [sys.executable, "-S", "-c", compact(agent_source()), "serve"],
        input="".join(json.dumps(r.to_json()) + "\n" for r in requests),
        capture_output=True, text=True, timeout=60, check=False)
    return agent_replies(proc)


def test_the_serving_agent_says_the_newest_checkpoint_and_the_last_logged_step(
        tmp_path: Path) -> None:
    run_dir, elsewhere = tmp_path / "run", tmp_path / "ckpt"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-00000020.pt").write_bytes(b"")
    (run_dir / "checkpoints" / "step-00000040.pt").write_bytes(b"")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "step", "step": 47}) + "\n")
    elsewhere.mkdir()
    (elsewhere / "step-00000090.pt").write_bytes(b"")
    replies = _serve(TrainingProgress(str(run_dir)),
                     TrainingProgress(str(run_dir), str(elsewhere)),
                     TrainingProgress(str(tmp_path / "fresh")))
    assert [kind for kind, _ in replies] == ["ready", "progress", "progress", "progress"]
    assert replies[1][1] == {"checkpoint_step": 40, "step": 47}
    assert replies[2][1] == {"checkpoint_step": 90, "step": 47}  # the job's checkpoint_dir
    assert replies[3][1] == {"checkpoint_step": None, "step": None}  # a first attempt's
