"""The planner's traced memory estimate, through ``orchestrate plan`` as a user runs it.

``load`` builds the job's model in a child process (orchestrate/train/modelfacts.py): on the
meta device for its size and layout, then one traced step per layout on fake tensors. Checked
here: a 3.1e9-parameter block model that does not fit an RTX A6000 as a DDP replica is planned
to FSDP on the README's mixed server with traced numbers; a wrap class the model lacks is exit 2
naming the classes it has; a factory slower than the deadline falls back to the formula's plan
(or none) and says why, inside the deadline.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.trainranks import DIGITS, REPO, TRAIN_TESTS, base_env

pytestmark = [pytest.mark.process, pytest.mark.torch]


def _job(tmp_path: Path, train: dict[str, Any], **resources: Any) -> Path:
    (tmp_path / "lab.yaml").write_text((REPO / "inventory" / "lab.yaml").read_text())
    job = {"name": "big", "backend": "ssh", "inventory": "lab.yaml",
           "resources": {"nodes": 1, "node_names": ["ambers"], **resources},
           "train": {"dataset": "digits:build_dataset", "batch_size": 8, **train}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _plan(path: Path, *args: str, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    environ = base_env() | {"PYTHONPATH": os.pathsep.join([str(REPO), str(DIGITS),
                                                          str(TRAIN_TESTS)]),
                            "ORCHESTRATE_HOME": str(path.parent / "state")}  # its trace cache
    return subprocess.run([sys.executable, "-m", "orchestrate", "plan", str(path), *args],
                          capture_output=True, text=True, env=environ | (env or {}),
                          cwd=path.parent, timeout=180)


BIG = {"model": "train_probe:build_blocks", "model_args": {"width": 28_000, "depth": 4},
       "strategy": "auto", "activation_memory_gb": 1.0}


@pytest.mark.timeout(200)
def test_auto_traces_a_model_too_big_for_ddp_and_picks_fsdp(tmp_path: Path) -> None:
    done = _plan(_job(tmp_path, BIG, gpus_per_node=6, gpu_model="RTX-A6000"), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    plan = json.loads(done.stdout)
    memory = plan["memory"]
    assert memory["strategy"] == "fsdp"
    rows = {(e["strategy"], e["gpu_model"]): e for e in memory["estimates"]}
    ddp, fsdp = rows["ddp", "RTX-A6000"], rows["fsdp", "RTX-A6000"]
    assert (ddp["method"], fsdp["method"]) == ("traced", "traced")
    assert not ddp["fits"] and fsdp["fits"]
    # AdamW in fp32 keeps 16 bytes a parameter: a replica of 4 x 28,000^2 = 3.14e9 is 50.2 GB
    # (+ 1.5 GB of CUDA overhead and the activations: over an A6000's 48 GiB = 51.54 GB), a
    # sixth of it sharded over six ranks about 8 GB, + the gathered units and the overhead:
    # the end of the forward pass (traced at 2 ranks: 20.4 GB of shards, 9.4 GB of gathered
    # units, three of 3.1 GB, 3.1 GB of activations) carried to six ranks is
    # 20.4 / 3 + 9.4 + 3.1 + 1.5 = 20.9 GB, above the optimizer step's 36.1 / 3 + 1.5 = 13.5
    assert fsdp["capacity_gb"] == pytest.approx(51.54)
    assert ddp["peak_gb"] > 51.54
    assert 17 < fsdp["peak_gb"] < 25
    assert plan["train_config"]["strategy"] == "fsdp"


@pytest.mark.timeout(200)
def test_wrap_class_the_model_lacks_is_exit_2_naming_its_classes(tmp_path: Path) -> None:
    job = _job(tmp_path, BIG | {"strategy": "fsdp", "fsdp": {"wrap": ["LlamaDecoderLayer"]}},
               gpus_per_node=2, gpu_model="A100-80GB")
    done = _plan(job)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "LlamaDecoderLayer" in done.stderr and "Block" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(200)
def test_a_factory_slower_than_the_deadline_is_planned_without_it(tmp_path: Path) -> None:
    job = _job(tmp_path, {"model": "train_probe:build_slow", "model_args": {"delay_s": 60},
                          "strategy": "auto", "memory_trace_s": 3},
               gpus_per_node=2, gpu_model="A100-80GB")
    started = time.monotonic()
    done = _plan(job)
    assert time.monotonic() - started < 30
    assert done.returncode == 0, done.stdout + done.stderr
    assert "took over 3 s (train.memory_trace_s)" in done.stdout + done.stderr


@pytest.mark.timeout(200)
def test_a_second_plan_reuses_the_trace(tmp_path: Path) -> None:
    job = _job(tmp_path, {"model": "digits:build_model", "strategy": "fsdp"},
               gpus_per_node=2, gpu_model="A100-80GB")
    first = _plan(job, "--json")
    assert first.returncode == 0, first.stdout + first.stderr
    started = time.monotonic()
    again = _plan(job, "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    one, two = (json.loads(done.stdout)["memory"] for done in (first, again))
    assert one["estimates"] == two["estimates"] and one["estimates"][0]["method"] == "traced"
    assert not one["notes"] and any("reused" in note for note in two["notes"])
    assert time.monotonic() - started < 15  # no model probe: the CLI's start and the plan
    assert list((tmp_path / "state" / "traces").glob("*.json"))


#: A factory that prints to stdout, starts a process in a session of its own and one that
#: listens on a port, records their pids and the port, and returns a model; and one that exits.
NOISY = """
import json, subprocess, sys
import torch

LISTEN = ("import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
          "print(s.getsockname()[1], flush=True); time.sleep(300)")


def build_model(record):
    print("the factory talks on stdout", flush=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                               start_new_session=True)
    server = subprocess.Popen([sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline())
    with open(record, "a") as f:
        f.write(json.dumps({"pids": [sleeper.pid, server.pid], "port": port}) + "\\n")
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def build_exit():
    sys.exit(3)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(200)
def test_the_model_probe_answers_on_its_own_pipe_and_leaves_nothing(tmp_path: Path) -> None:
    """Issue #33 item 7: a factory that prints no longer breaks the plan (JSONDecodeError);
    what it starts (a process in its own session, a listening port) is gone when plan returns."""
    (tmp_path / "noisy.py").write_text(NOISY)
    record = tmp_path / "started.jsonl"
    job = _job(tmp_path, {"model": "noisy:build_model", "model_args": {"record": str(record)},
                          "strategy": "fsdp"}, gpus_per_node=2, gpu_model="A100-80GB")
    done = _plan(job, "--json", env={"ORCHESTRATE_TRACE_CACHE": "0"})
    assert done.returncode == 0, done.stdout + done.stderr
    memory = json.loads(done.stdout)["memory"]
    assert memory["estimates"][0]["method"] == "traced", memory
    started = [json.loads(line) for line in record.read_text().splitlines()]
    assert started  # the factory ran (once per layout and for the facts)
    for each in started:
        assert not [pid for pid in each["pids"] if _alive(pid)], each
        with socket.socket() as probe:  # the port is free again
            probe.bind(("127.0.0.1", each["port"]))


@pytest.mark.timeout(200)
def test_a_factory_that_exits_is_named_by_its_exit(tmp_path: Path) -> None:
    (tmp_path / "noisy.py").write_text(NOISY)
    job = _job(tmp_path, {"model": "noisy:build_exit", "strategy": "auto",
                          "memory_trace_s": 60}, gpus_per_node=2, gpu_model="A100-80GB")
    started = time.monotonic()
    done = _plan(job, env={"ORCHESTRATE_TRACE_CACHE": "0"})
    text = done.stdout + done.stderr
    assert "sys.exit(3)" in text, text
    assert "took over" not in text
    assert time.monotonic() - started < 60
