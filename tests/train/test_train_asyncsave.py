"""Background checkpoints and tracking across attempts, in one process: the host copy shares
nothing with the live tensors, the memory check reads /proc/meminfo as the kernel writes it,
one write is in flight at a time and its failure surfaces in the training thread, and every
attempt of a job logs as the same W&B run."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.train import asyncsave
from orchestrate.train.tracking import ID_FILE, tracking_for, wandb_options

pytestmark = pytest.mark.unit

# The head of a real /proc/meminfo (a 23 GiB machine).
MEMINFO = """MemTotal:       24568152 kB
MemFree:        19988116 kB
MemAvailable:   22103384 kB
Buffers:          123456 kB
Cached:          2001136 kB
"""


def test_the_snapshot_is_a_host_copy_the_next_step_cannot_change() -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    live = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7}
    copy = asyncsave.snapshot(live)
    before = copy["model"]["weight"].clone(), copy["optimizer"]["state"][0]["exp_avg"].clone()
    optimizer.step()  # changes the weights and the moments in place
    assert not torch.equal(model.weight, before[0])
    assert torch.equal(copy["model"]["weight"], before[0])
    assert torch.equal(copy["optimizer"]["state"][0]["exp_avg"], before[1])
    assert copy["step"] == 7 and copy["optimizer"]["param_groups"][0]["params"] == [0, 1]
    assert asyncsave.tensor_bytes(live["model"]) == (4 * 3 + 3) * 4


def test_the_next_save_copies_into_the_same_host_buffers_and_reallocates_what_changed() -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    host = asyncsave.HostCopy()
    first = host.take({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    host.ready()  # nothing queued on a device: returns at once
    buffers = {name: t.data_ptr() for name, t in first["model"].items()}
    moment = first["optimizer"]["state"][0]["exp_avg"].data_ptr()
    optimizer.step()
    second = host.take({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    # The same memory, now holding the new values (no allocation, no page faults)...
    assert {name: t.data_ptr() for name, t in second["model"].items()} == buffers
    assert second["optimizer"]["state"][0]["exp_avg"].data_ptr() == moment
    assert torch.equal(second["model"]["weight"], model.weight)
    assert torch.equal(second["optimizer"]["state"][0]["exp_avg"],
                       optimizer.state[model.weight]["exp_avg"])
    assert second["model"]["weight"].data_ptr() != model.weight.data_ptr()
    # ...while a tensor whose shape or dtype changed gets a buffer of its own.
    third = host.take({"model": {"weight": torch.zeros(5, 4), "bias": model.bias.double()}})
    assert third["model"]["weight"].shape == (5, 4)
    assert third["model"]["bias"].dtype == torch.float64
    assert third["model"]["weight"].data_ptr() != buffers["weight"]


def test_host_memory_is_read_from_meminfo_and_a_copy_too_big_is_refused_with_numbers() -> None:
    available = asyncsave.available_bytes(MEMINFO)
    assert available == 22103384 * 1024
    assert asyncsave.available_bytes("MemTotal: 1 kB\n") is None
    assert asyncsave.room_problem(4 * 10**9, 2, available) is None
    problem = asyncsave.room_problem(12 * 10**9, 2, available)
    assert problem is not None
    assert "2 ranks x 12.00 GB" in problem and "22.63 GB available" in problem
    assert asyncsave.room_problem(10**12, 1, None) is None  # unknown: nothing to say


def test_one_write_in_flight_and_its_failure_is_raised_where_it_is_waited_for() -> None:
    writer = asyncsave.Writer()
    release = threading.Event()
    writer.start("step-00000005.pt", release.wait)
    assert writer.busy == "step-00000005.pt"
    with pytest.raises(AssertionError, match="one write in flight"):
        writer.start("step-00000006.pt", lambda: None)
    release.set()
    waited = writer.wait()
    assert waited is not None and waited[0] == "step-00000005.pt"
    assert writer.busy is None and writer.wait() is None

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    writer.start("step-00000010.pt", full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()


def test_every_attempt_of_a_job_logs_as_one_run_tagged_with_its_attempt(tmp_path: Path) -> None:
    spec = TrainSpec.model_validate({"model": "m:f", "dataset": "m:g", "wandb": True})
    first = tracking_for(tmp_path, {"ORCHESTRATE_JOB_ID": "digits-20261205-0537-ab12",
                                    "ORCHESTRATE_ATTEMPT": "1"})
    third = tracking_for(tmp_path, {"ORCHESTRATE_JOB_ID": "digits-20261205-0537-ab12",
                                    "ORCHESTRATE_ATTEMPT": "3"})
    assert first.run_id == third.run_id == "digits-20261205-0537-ab12"
    options = wandb_options(third, tmp_path, spec, {"WANDB_PROJECT": "lab"})
    assert (options["id"], options["resume"], options["tags"]) == (
        "digits-20261205-0537-ab12", "allow", ["attempt-3"])
    assert options["project"] == "lab" and options["config"]["wandb"] is True
    # Started by hand (no job id): an id kept in the run directory, the same next time.
    by_hand = tracking_for(tmp_path, {})
    assert (tmp_path / ID_FILE).read_text().strip() == by_hand.run_id
    assert tracking_for(tmp_path, {"ORCHESTRATE_ATTEMPT": "2"}).run_id == by_hand.run_id
    assert tracking_for(tmp_path, {"ORCHESTRATE_ATTEMPT": "x"}).attempt == 1


def test_weights_are_finite_unless_one_is_nan_or_infinite_even_when_their_sum_overflows(
        ) -> None:
    """The check before every checkpoint sums each weight (a finite sum holds no NaN or
    infinity) and looks element by element only where the sum is not finite."""
    from orchestrate.train import sharding

    model = torch.nn.Linear(4, 3).half()
    with torch.no_grad():
        model.weight.fill_(60000.0)  # finite, but the sum overflows float16
    assert sharding.all_finite(model)
    with torch.no_grad():
        model.bias[1] = float("nan")
    assert not sharding.all_finite(model)
    with torch.no_grad():
        model.bias[1] = float("-inf")
    assert not sharding.all_finite(model)
