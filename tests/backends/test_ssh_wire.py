"""The SSH agent's protocol records (review C2): what the controller sends is what the agent
reads, and a request that does not fit its record is refused by name, never read as None."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrate.backends.ssh.wire import (
    REQUESTS,
    Abort,
    Claim,
    End,
    Exited,
    Files,
    Listen,
    Preflight,
    Queue,
    Reach,
    Start,
    StepAnswer,
    TrainingProgress,
    Unlisten,
    WireError,
    read_request,
)

pytestmark = pytest.mark.unit

EXAMPLES = [
    Preflight(job_id="j-1", workdir="/w", python="python3", torch=True,
              orchestrate="orchestrate.train", master_addr="10.0.0.5", gpus=True,
              ports=[24331, 24332], lease_dir=None, want={"gpus": [0]}),
    Claim(job_id="j-1", node="gpu-a", gpus=[0, 1], slots=0, port=24331,
          ticket={"job": "j-1"}),
    Queue(job_id="j-1", ticket={"job": "j-1"}, lease_dir="/var/tmp/book"),
    Files(run_dir="/r", files={"launch-gpu-a.sh": "#!/bin/bash\n"}),
    TrainingProgress(run_dir="/r", checkpoint_dir="/ckpt"),
    Start(job_id="j-1", script="/r/launch-gpu-a.sh", local_rank=None, grace_s=5.0,
          env={"ORCHESTRATE_ATTEMPT": "1"}),
    End(grace_s=2.5), Abort(), Listen(24331), Unlisten(), Reach("10.0.0.5", 24331),
]


@pytest.mark.parametrize("record", EXAMPLES, ids=lambda r: r.OP)
def test_a_request_reads_back_as_the_record_sent(record: Any) -> None:
    line = json.dumps(record.to_json())  # what crosses the channel
    assert read_request(json.loads(line)) == record


def test_every_request_has_an_example() -> None:
    assert sorted(REQUESTS) == sorted(r.OP for r in EXAMPLES)


@pytest.mark.parametrize(("data", "said"), [
    ({"op": "claim", "job": "j-1", "node": "a"}, "claim: unknown field(s) job"),
    ({"op": "claim", "node": "a"}, "claim: missing field job_id"),
    ({"op": "claim", "job_id": "j-1", "node": "a", "gpus": "0,1"},
     "claim: gpus must be list[int] (got str)"),
    ({"op": "listen", "port": True}, "listen: port must be int (got bool)"),
    ({"op": "start", "job_id": "j", "script": "s", "local_rank": "0"},
     "start: local_rank must be int | None (got str)"),
    ({"op": "launch"}, "unknown request 'launch'"),
    (["start"], "a request is a JSON object"),
])
def test_a_request_that_does_not_fit_is_refused_by_name(data: Any, said: str) -> None:
    with pytest.raises(WireError) as caught:
        read_request(data)
    assert str(caught.value) == said


def test_replies_carry_no_op_and_read_back() -> None:
    exited = Exited(code=None, signal=9, left=0)
    assert exited.to_json() == {"code": None, "signal": 9, "left": 0}
    assert Exited.from_json({"signal": 9, "left": 0}) == exited
    assert StepAnswer.from_json({"ok": False, "detail": "Permission denied: /r"}).detail == \
        "Permission denied: /r"
    with pytest.raises(WireError, match="StepAnswer: missing field ok"):
        StepAnswer.from_json({"detail": "x"})
