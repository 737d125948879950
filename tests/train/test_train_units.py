"""The entrypoint's pure parts, in process: checkpoints, key prefixes, schedules, factories."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from orchestrate.core.errors import UserError
from orchestrate.core.metricrecord import MetricRecord
from orchestrate.core.spec.trainspec import SchedulerSpec, TrainSpec
from orchestrate.train import checkpoint
from orchestrate.train.distributed import backend_from, timeout_from
from orchestrate.train.factories import call, resolve
from orchestrate.train.failure import TrainFailure
from orchestrate.train.metrics import format_epoch
from orchestrate.train.optimizer import lr_factor
from orchestrate.train.params import param_count
from orchestrate.train.sampling import ResumableSampler, validation_shard

pytestmark = pytest.mark.unit

# --- factories ---------------------------------------------------------------------------


def test_import_path_errors_name_the_field_and_are_the_jobs_mistake() -> None:
    """A path that does not import exits 2 on the rank (issue #33): a UserError naming the
    field, with a did-you-mean."""
    with pytest.raises(UserError) as caught:
        resolve("no_such_module_xyz:build", "model factory")
    assert str(caught.value).startswith(
        "train.model: model factory module 'no_such_module_xyz' not found "
        "(got no_such_module_xyz:build)\n  hint: the job's workdir and PYTHONPATH are searched")
    with pytest.raises(UserError, match=r"train\.dataset: dataset factory math has no attribute"):
        resolve("math:nope", "dataset factory")
    with pytest.raises(UserError, match=r"did you mean 'sqrt'\?"):
        resolve("math:sqrtt", "dataset factory")
    with pytest.raises(UserError, match=r"train\.loss: loss pi is not callable"):
        resolve("math:pi", "loss")


def test_factory_exception_is_one_line_naming_it() -> None:
    with pytest.raises(TrainFailure) as caught:
        call("train_probe:build_model", "model factory", {"fail_on_rank": 0})
    assert str(caught.value) == (
        "model factory train_probe:build_model raised ValueError: no model for rank 0 "
        "(a test asked this rank to fail)"
    )
    assert isinstance(caught.value.__cause__, ValueError)


def test_arguments_a_factory_does_not_take_are_a_model_args_mistake() -> None:
    with pytest.raises(UserError) as caught:
        call("digits:build_model", "model factory", {"hiden": 3})
    text = str(caught.value)
    assert text.startswith("train.model_args: model factory cannot be called with these "
                           "arguments: got an unexpected keyword argument 'hiden'"), text
    assert "did you mean 'hidden'?" in text


# --- the module. prefix, both ways ---------------------------------------------------------


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_prefixed_state_loads_into_plain_model() -> None:
    source, target = _model(), _model()
    prefixed = {f"module.{k}": v for k, v in source.state_dict().items()}
    assert checkpoint.load_model_state(target, prefixed, strict=True, source="x") == []
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)


def test_plain_state_loads_into_model_whose_keys_are_prefixed() -> None:
    """A model that itself wraps a submodule called ``module`` expects prefixed keys."""

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = _model()

    source, target = _model(), Wrapper()
    checkpoint.load_model_state(target, source.state_dict(), strict=True, source="x")
    assert torch.equal(target.module[0].weight, source[0].weight)


def test_mismatched_keys_are_reported() -> None:
    state = OrderedDict(_model().state_dict())
    state.pop("2.bias")
    state["extra.weight"] = torch.zeros(1)
    with pytest.raises(TrainFailure) as caught:
        checkpoint.load_model_state(_model(), state, strict=True, source="checkpoint c.pt")
    assert str(caught.value) == (
        "checkpoint c.pt does not fit the model: 1 missing key(s): 2.bias; "
        "1 unexpected key(s): extra.weight"
    )
    notes = checkpoint.load_model_state(_model(), state, strict=False, source="init_from")
    assert notes == ["1 missing key(s): 2.bias", "1 unexpected key(s): extra.weight"]


def test_shape_mismatch_and_nothing_matching_are_errors() -> None:
    wrong = {k: torch.zeros(7) for k in _model().state_dict()}
    with pytest.raises(TrainFailure, match="does not fit the model: size mismatch"):
        checkpoint.load_model_state(_model(), wrong, strict=False, source="init_from")
    with pytest.raises(TrainFailure) as caught:
        checkpoint.load_model_state(_model(), {"a": torch.zeros(1)}, strict=False, source="x")
    assert str(caught.value) == (
        "x does not fit the model: 4 missing key(s): 0.bias, 0.weight, 2.bias, 2.weight; "
        "1 unexpected key(s): a"
    )


def test_model_state_found_inside_common_wrappers() -> None:
    inner = _model().state_dict()
    for wrapper in ({"model": inner}, {"state_dict": inner}, {"model_state_dict": inner}, inner):
        assert checkpoint.model_state_of(wrapper).keys() == inner.keys()


# --- atomic files, latest, pruning ---------------------------------------------------------


def test_save_keeps_the_newest_and_points_latest(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        checkpoint.save({"step": step}, tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step-00000030.pt", "step-00000040.pt",
    ]
    latest = checkpoint.find_latest(tmp_path)
    assert latest is not None and checkpoint.load(latest)["step"] == 40


def test_failed_write_keeps_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    target.write_text("step-00000010.pt\n")

    def explode(handle: object) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError):
        checkpoint.write_atomic(target, explode)
    assert target.read_text() == "step-00000010.pt\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_find_latest_falls_back_and_temporaries_are_cleaned(tmp_path: Path) -> None:
    assert checkpoint.find_latest(tmp_path / "none") is None
    checkpoint.save({"step": 5}, tmp_path, 5, keep=3)
    checkpoint.save({"step": 6}, tmp_path, 6, keep=3)
    (tmp_path / "latest").unlink()  # killed between the checkpoint and the pointer
    torn = tmp_path / ".step-00000007.pt.tmp-1234"
    torn.write_bytes(b"\x80half a pickle")
    assert checkpoint.find_latest(tmp_path) == tmp_path / "step-00000006.pt"
    assert checkpoint.clean_temporaries(tmp_path) == [torn]
    assert not torn.exists()


def test_load_refuses_garbage_with_a_clear_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(TrainFailure, match=f"cannot load {bad}"):
        checkpoint.load(bad)
    with pytest.raises(TrainFailure, match="not found"):
        checkpoint.load(tmp_path / "missing.pt")


# --- schedule ------------------------------------------------------------------------------


def test_lr_factor_warmup_then_decay() -> None:
    cosine = SchedulerSpec(name="cosine", warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_factor(cosine, s, 104) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(cosine, 4, 104) == 1.0
    assert lr_factor(cosine, 54, 104) == pytest.approx(0.55)
    assert lr_factor(cosine, 104, 104) == pytest.approx(0.1)
    assert lr_factor(cosine, 500, 104) == pytest.approx(0.1)
    linear = SchedulerSpec(name="linear")
    assert lr_factor(linear, 25, 100) == pytest.approx(0.75)
    constant = SchedulerSpec(name="constant", warmup_steps=2)
    assert [lr_factor(constant, s, 10) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert math.isclose(lr_factor(SchedulerSpec(), 0, 1), 1.0)


# --- sampling -------------------------------------------------------------------------------


def test_resumable_sampler_skips_the_start_of_its_epoch() -> None:
    data = list(range(101))
    for rank in range(3):
        reference = DistributedSampler(data, num_replicas=3, rank=rank, seed=9, drop_last=True)
        mine = ResumableSampler(data, num_replicas=3, rank=rank, seed=9)
        reference.set_epoch(4)
        mine.set_epoch(4)
        assert list(mine) == list(reference) and len(mine) == 33
        mine.skip = 10
        assert list(mine) == list(reference)[10:] and len(mine) == 23


def test_validation_shards_cover_each_sample_once() -> None:
    shards = [list(validation_shard(list(range(10)), r, 4)) for r in range(4)]
    assert shards == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]


# --- the environment knobs of the group ---------------------------------------------------------


def test_backend_and_timeout_from_environment() -> None:
    assert backend_from({}, cuda=False) == "gloo"
    assert backend_from({}, cuda=True) == "nccl"
    assert backend_from({"ORCHESTRATE_DIST_BACKEND": "gloo"}, cuda=True) == "gloo"
    with pytest.raises(UserError, match="ORCHESTRATE_DIST_BACKEND: nccl needs CUDA GPUs"):
        backend_from({"ORCHESTRATE_DIST_BACKEND": "nccl"}, cuda=False)
    with pytest.raises(UserError, match="must be nccl or gloo"):
        backend_from({"ORCHESTRATE_DIST_BACKEND": "mpi"}, cuda=False)
    assert timeout_from({}) == 300.0
    assert timeout_from({"ORCHESTRATE_TIMEOUT_S": "42.5"}) == 42.5
    for bad in ("0", "-3", "soon", "inf"):
        with pytest.raises(UserError, match="ORCHESTRATE_TIMEOUT_S"):
            timeout_from({"ORCHESTRATE_TIMEOUT_S": bad})


# --- the planner's parameter count -------------------------------------------------------------


def test_param_count_on_meta_device() -> None:
    small = TrainSpec(model="digits:build_model", dataset="digits:build_dataset",
                      model_args={"hidden": 128})
    assert param_count(small) == 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    started = time.monotonic()
    huge = small.model_copy(update={"model_args": {"hidden": 200_000}})  # 40 G parameters
    assert param_count(huge) == 64 * 200_000 + 200_000 + 200_000**2 + 200_000 + 2_000_010
    assert time.monotonic() - started < 10, "nothing is allocated"


def test_param_count_uses_the_workdir(tmp_path: Path) -> None:
    (tmp_path / "tiny_model_mod.py").write_text(
        "import torch\ndef build():\n    return torch.nn.Linear(2, 3)\n"
    )
    spec = TrainSpec(model="tiny_model_mod:build", dataset="tiny_model_mod:build")
    assert param_count(spec, workdir=tmp_path) == 9


def test_epoch_line_for_people() -> None:
    record = MetricRecord.from_json({
        "kind": "epoch", "epoch": 3, "step": 69, "train_loss": 0.32861, "val_loss": 0.2592,
        "val_accuracy": 0.93611, "samples_per_s": 13828.4, "epoch_s": 0.113,
        "peak_memory_gb": [1.25, 1.5]})
    assert record is not None
    assert format_epoch(record, 8) == (
        "epoch 3/8  step 69  train_loss 0.3286  val_loss 0.2592  val_acc 0.9361  "
        "13828 samples/s  0.11 s  peak 1.2/1.5 GB"
    )


def test_a_global_batch_larger_than_the_training_set_says_so() -> None:
    """Issue #33 item 7: the sentence names the global batch, not the rank count."""
    from orchestrate.train.build import _too_small

    spec = TrainSpec.model_validate({"model": "m:f", "dataset": "d:f",
                                     "global_batch_size": 128, "batch_split": "equal"})
    error = _too_small(spec, 64, 2)
    assert isinstance(error, UserError)
    assert str(error) == (
        "train.global_batch_size: the training set has 64 samples, fewer than one global batch "
        "(128 samples per optimizer step over all ranks): not one step per epoch (got 128)\n"
        "  hint: set global_batch_size to at most 64, or give a larger dataset")
    plain = TrainSpec.model_validate({"model": "m:f", "dataset": "d:f"})
    assert "fewer than the 4 ranks" in str(_too_small(plain, 3, 4))
