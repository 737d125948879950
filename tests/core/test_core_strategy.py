"""The planner's layout and batch-share decisions, plan-only (issues #24 and #22).

The README's mixed server (inventory/lab.yaml: ambers has 2x A100-80GB and 6x RTX-A6000, birch
4x RTX-A6000) and the field notes' models: a 6.7e9-parameter LLaMA fits one GPU but not DDP on an
A6000, and a 13e9 one does not fit DDP even on an A100. With ``strategy: auto`` the planner picks
the first layout whose estimate fits every planned GPU and says which and why; the numbers are
the formula's (``model_params``), traced peaks are carried over to other world sizes and batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrate.core.errors import UserError
from orchestrate.core.plan.memory import GB, ModelFacts, TracedPeak, capacity_bytes, formula
from orchestrate.core.plan.plan import Plan, make_plan
from orchestrate.core.plan.shares import apportion, known_speed
from orchestrate.core.spec.inventory import load_inventory
from orchestrate.core.spec.job import JobSpec
from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.probe.facts import memory_gb

pytestmark = pytest.mark.unit

LAB = load_inventory(Path(__file__).resolve().parents[2] / "inventory" / "lab.yaml")


def job(train: dict[str, Any], **resources: Any) -> JobSpec:
    return JobSpec.model_validate({
        "name": "j", "backend": "ssh", "inventory": "lab.yaml",
        "resources": {"nodes": 1, "node_names": ["ambers"], **resources},
        "train": {"model": "m:f", "dataset": "d:f", **train}})


def plan(spec: JobSpec, **kw: Any) -> Plan:
    return make_plan(spec, LAB, job_id="j-1", run_dir="/runs/j-1", workdir="/w", source="j.yaml",
                     **kw)


def refusal(spec: JobSpec, **kw: Any) -> str:
    with pytest.raises(UserError) as caught:
        plan(spec, **kw)
    assert caught.value.exit_status == 2
    return str(caught.value)


# ---------------------------------------------------------------- strategy: auto


def test_auto_keeps_ddp_for_a_model_that_fits_every_gpu() -> None:
    p = plan(job({"strategy": "auto", "model_params": 1.8e4}, allow_mixed_gpus=True))
    assert p.memory is not None and p.memory.layout == "ddp"
    assert p.train_config is not None and p.train_config["strategy"] == "ddp"
    rows = {(e.strategy, e.gpu_model): e for e in p.memory.estimates}
    assert rows["ddp", "RTX-A6000"].fits and rows["ddp", "A100-80GB"].fits


def test_auto_picks_fsdp_for_the_6b_model_on_the_mixed_server() -> None:
    p = plan(job({"strategy": "auto", "model_params": 6.7e9, "batch_size": 1},
                 allow_mixed_gpus=True))
    assert p.memory is not None and p.memory.layout == "fsdp"
    assert p.world_size == 8
    rows = {(e.strategy, e.gpu_model): e for e in p.memory.estimates}
    # DDP: 16 bytes per parameter (fp32 AdamW) = 107.2 GB + the 2 GB allowance on every GPU
    assert rows["ddp", "A100-80GB"].peak_gb == pytest.approx(109.2)
    assert rows["ddp", "A100-80GB"].fits is False and rows["ddp", "RTX-A6000"].fits is False
    # FSDP over 8 ranks: 107.2 / 8 = 13.4 GB of shards + the gathered units + activations
    fsdp = rows["fsdp", "RTX-A6000"]
    # the inventory's 48 (GiB, nvidia-smi's 49,140 MiB / 1024) is 48 x 2^30 = 51.54e9 bytes
    assert fsdp.fits and fsdp.capacity_gb == 51.54 and fsdp.method == "formula"
    assert fsdp.parts["weights"] + fsdp.parts["gradients"] + fsdp.parts["optimizer"] == (
        pytest.approx(13.4))
    assert p.train_config is not None and p.train_config["strategy"] == "fsdp"
    assert any("bounded by the smallest GPU" in n for n in p.notes)


def test_the_13b_model_that_oomed_on_an_a100_plans_to_fsdp_on_a6000s() -> None:
    spec = job({"strategy": "auto", "model_params": 13e9, "batch_size": 1},
               gpu_model="RTX-A6000", nodes=2)
    p = make_plan(spec.model_copy(update={"resources": spec.resources.model_copy(
        update={"node_names": None})}), LAB, job_id="j", run_dir="/r", workdir="/w")
    assert p.world_size == 10 and p.memory is not None
    assert p.memory.layout in ("fsdp", "fsdp+ac")
    assert all(e.fits for e in p.memory.estimates if e.strategy == p.memory.layout)
    assert p.memory.total < 48 * GB


def test_plan_json_carries_the_decision_and_every_estimate() -> None:
    p = plan(job({"strategy": "auto", "model_params": 6.7e9, "batch_size": 1},
                 allow_mixed_gpus=True))
    memory = json.loads(json.dumps(p.to_json()))["memory"]
    assert memory["strategy"] == "fsdp"
    assert {"strategy", "gpu_model", "peak_gb", "capacity_gb", "fits", "method"} <= set(
        memory["estimates"][0])
    assert {(e["strategy"], e["gpu_model"]) for e in memory["estimates"]} >= {
        ("ddp", "A100-80GB"), ("ddp", "RTX-A6000"), ("fsdp", "RTX-A6000"),
        ("fsdp+ac", "RTX-A6000")}
    again = Plan.from_json(p.to_json())
    assert again.memory == p.memory


def test_nothing_fits_shows_every_layouts_numbers() -> None:
    message = refusal(job({"strategy": "auto", "model_params": 70e9, "batch_size": 1},
                          allow_mixed_gpus=True))
    assert "fits no layout the job allows" in message
    for layout in ("ddp:", "fsdp:", "fsdp+ac:"):
        assert layout in message
    # 70e9 x 16 bytes = 1120 GB + the 2 GB allowance, against 80 GiB = 80 x 2^30 = 85.9e9
    assert "1122.0 GB of 85.9 GB (80 GiB)" in message and "GB of 51.5 GB (48 GiB)" in message


def test_explicit_ddp_keeps_the_old_refusal_and_names_fsdp() -> None:
    message = refusal(job({"model_params": 6.7e9}, gpu_model="RTX-A6000"))
    assert "need ~107 GB per GPU before activations" in message
    assert "train.strategy: fsdp" in message


def test_activation_checkpointing_shrinks_the_formulas_activations() -> None:
    train = TrainSpec(model="m:f", dataset="d:f", activation_memory_gb=9.0)
    plain = formula(train, 1e9, option="fsdp", world=4, batch=None)
    checkpointed = formula(train, 1e9, option="fsdp+ac", world=4, batch=None)
    assert plain.activations == 9 * GB and checkpointed.activations == 3 * GB
    assert checkpointed.weights == plain.weights == 1e9


def test_a_traced_peak_follows_the_world_size_and_the_batch() -> None:
    traced = TracedPeak("fsdp", world_size=8, batch=4, weights=1 * GB, gradients=1 * GB,
                        optimizer=2 * GB, gathered=0.5 * GB, activations=4 * GB, seconds=1.0)
    facts = ModelFacts(params=2e9, traced=(traced,))
    p = plan(job({"strategy": "fsdp", "batch_size": 8}, allow_mixed_gpus=True, ),
             model=facts)
    assert p.memory is not None
    row = next(e for e in p.memory.estimates if e.gpu_model == "RTX-A6000")
    assert row.method == "traced"
    # 8 ranks as traced: shards unchanged; 8 samples instead of 4: activations doubled;
    # plus the GPU's CUDA context and NCCL buffers
    assert row.peak_gb == pytest.approx(1 + 1 + 2 + 0.5 + 8 + 1.5)


def test_capacity_is_the_probes_mib_in_bytes() -> None:
    # nvidia-smi's memory.total in MiB -> the inventory's memory_gb (GiB) -> the planner's bytes
    for mib, gib in ((49_140, 48), (81_920, 80)):
        assert memory_gb(mib) == gib
        # 49,140 MiB x 2^20 = 51.53e9 bytes; the inventory's whole 48 GiB = 51.54e9 (12 MiB more)
        assert capacity_bytes(memory_gb(mib)) == pytest.approx(mib * 2**20, rel=3e-4)
    assert capacity_bytes(48) == 48 * 2**30 == pytest.approx(51.54e9, abs=0.01e9)
    assert capacity_bytes(80) == pytest.approx(85.90e9, abs=0.01e9)
    p = plan(job({"strategy": "fsdp", "model_params": 1e6}, allow_mixed_gpus=True))
    assert p.memory is not None
    shown = {e.gpu_model: e.capacity_gb for e in p.memory.estimates}
    assert shown == {"A100-80GB": 85.899, "RTX-A6000": 51.54}


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(("train", "field", "says"), [
    ({"strategy": "fsdp", "precision": "fp16"}, "train.precision", "no sharded one"),
    ({"strategy": "auto", "precision": "fp16-mixed"}, "train.precision", "use bf16"),
    ({"fsdp": {"cpu_offload": True}}, "train.fsdp.cpu_offload", "strategy: fsdp"),
    ({"batch_split": "proportional"}, "train.batch_split", "global_batch_size"),
    ({"global_batch_size": 64, "batch_size": 8}, "train.batch_size", "not both"),
    ({"global_batch_size": 63, "grad_accum_steps": 2}, "train.global_batch_size", "multiple"),
    ({"global_batch_size": 64, "batch_split": "measured", "strategy": "fsdp"},
     "train.batch_split", "proportional"),
])
def test_combinations_that_cannot_work_are_refused(train: dict[str, Any], field: str,
                                                   says: str) -> None:
    message = refusal(job({"model_params": 1e6, **train}))
    assert f"j.yaml: {field}: " in message and says in message and "hint:" in message


# ---------------------------------------------------------------- batch shares (#22)


def test_known_speeds_match_the_inventory_names() -> None:
    assert known_speed("A100-80GB") == 312.0 and known_speed("RTX-A6000") == 154.8
    assert known_speed("H100-PCIe") == 756.0 and known_speed("Quantum-Q1") is None


def test_proportional_gives_the_a100s_twice_the_a6000s_share_within_memory() -> None:
    p = plan(job({"global_batch_size": 160, "batch_split": "proportional", "model_params": 1e9}))
    assert p.batch is not None and p.memory is not None
    by_model = {r.rank: r.gpu_model for r in p.ranks}
    a100 = [s for r, s in enumerate(p.batch.shares) if by_model[r] == "A100-80GB"]
    a6000 = [s for r, s in enumerate(p.batch.shares) if by_model[r] == "RTX-A6000"]
    assert len(a100) == 2 and len(a6000) == 6 and sum(p.batch.shares) == 160
    assert min(a100) / max(a6000) >= 1.8 and max(a100) / min(a6000) <= 2.25
    assert all(r.fits for r in p.memory.ranks)
    assert p.train_config is not None
    assert p.train_config["batch_plan"]["shares"] == list(p.batch.shares)
    # balanced: mixing needs no allow_mixed_gpus, and no "slowest GPU" warning
    assert not any("slowest" in w for w in p.warnings)


def test_a_share_is_capped_by_its_gpus_memory() -> None:
    # 10 GB of activations for the equal share of 8: ~1.25 GB a sample; the A6000s hold ~30
    p = plan(job({"global_batch_size": 64, "batch_split": "proportional",
                  "model_params": 1e9, "activation_memory_gb": 10.0}))
    assert p.batch is not None and p.memory is not None
    caps = dict(zip(range(8), p.batch.caps, strict=True))
    assert all(s <= (caps[r] or s) for r, s in enumerate(p.batch.shares))
    assert all(r.fits for r in p.memory.ranks)


def test_equal_split_on_mixed_gpus_keeps_the_warning() -> None:
    p = plan(job({"global_batch_size": 64, "model_params": 1e6}, allow_mixed_gpus=True))
    assert p.batch is not None and p.batch.shares == (8,) * 8
    assert any("slowest GPU" in w for w in p.warnings)


@pytest.mark.parametrize(("train", "says"), [
    ({"global_batch_size": 4}, "cannot give each of the 8 ranks a sample"),
    ({"global_batch_size": 64, "batch_shares": [32, 32]}, "2 shares for 8 ranks"),
    ({"global_batch_size": 64, "batch_shares": [8] * 7 + [9]}, "add up to 65"),
])
def test_splits_that_cannot_be_made_are_refused(train: dict[str, Any], says: str) -> None:
    message = refusal(job({"model_params": 1e6, **train}, allow_mixed_gpus=True))
    assert says in message


def test_a_global_batch_the_memory_cannot_hold_is_refused() -> None:
    # DDP, 1e9 parameters: 16 GB of states; 45 GB of activations for the equal share of
    # 4096 / 8 = 512 samples: 0.0879 GB a sample. An A6000 (51.54 GB) holds
    # floor(35.54 / 0.0879) = 404 samples, an A100 (85.90 GB) floor(69.90 / 0.0879) = 795:
    # 6 x 404 + 2 x 795 = 4014 < 4096
    message = refusal(job({"global_batch_size": 4096, "batch_split": "proportional",
                           "model_params": 1e9, "activation_memory_gb": 45.0}))
    assert "fits no layout" in message and "fewer than the global batch of 4096" in message


def test_batch_norm_with_unequal_shares_warns() -> None:
    facts = ModelFacts(params=1e6, batchnorm=("BatchNorm2d",))
    p = plan(job({"global_batch_size": 64, "batch_split": "proportional"}), model=facts)
    assert any("BatchNorm2d" in w and "per local batch" in w for w in p.warnings)
    # measured shares start equal and then move: the warning comes at plan time all the same
    p = plan(job({"global_batch_size": 64, "batch_split": "measured"}), model=facts)
    assert any("BatchNorm2d" in w for w in p.warnings)
    p = plan(job({"global_batch_size": 64}), model=facts)
    assert not any("BatchNorm2d" in w for w in p.warnings)


def test_apportion_never_exceeds_a_cap_and_sums_to_the_batch() -> None:
    shares = apportion(100, [3.0, 1.0, 1.0], [40, None, None])
    assert shares == [40, 30, 30]
    assert apportion(7, [1.0, 1.0, 1.0], [None] * 3) == [3, 2, 2]
    assert apportion(3, [100.0, 1.0, 1.0], [None] * 3) == [1, 1, 1]


# ---------------------------------------------------------------- advice, autocast (#34)


def test_the_refusals_hint_lists_only_layouts_the_planner_found_to_fit() -> None:
    # 13e9 under bf16-mixed FSDP on ambers' six A6000s (51.54 GB each): per rank
    # 13e9 x 16 / 6 = 34.67 GB of states; the gathered units (5% of the model each: 0.65e9)
    # 2 x 0.65e9 x 4 (fp32 gathers) + 2 x 0.65e9 x 4 (unsharded grads) = 10.4 GB; 2 GB of
    # activations; autocast's bf16 copy of every weight 2 x 13e9 = 26 GB: 73.1 GB, refused
    message = refusal(job({"strategy": "fsdp", "model_params": 13e9, "batch_size": 1,
                           "precision": "bf16-mixed"}, gpu_model="RTX-A6000"))
    assert "need up to 73.1 GB of 51.5 GB (48 GiB)" in message
    assert "the biggest part: autocast cache 26.0 GB of 73.1" in message
    hint = message.split("hint:")[1]
    # checkpointing drops the copies and keeps a third of the allowance:
    # 34.67 + 10.4 + 0.67 = 45.7
    assert "`strategy: auto` -> fsdp+ac: 45.7 GB of 51.5 GB (48 GiB) on RTX-A6000" in hint
    # FSDP's own mixed precision: no autocast; gathers in bf16: 2 x 0.65e9 x 2 + 5.2 = 7.8:
    # 34.67 + 7.8 + 2 = 44.5
    assert "fsdp: {mixed_precision: bf16}` -> fsdp: 44.5 GB" in hint
    # bf16 weights and AdamW state: 13e9 x 8 / 6 = 17.33; gathers 2 x 0.65e9 x (2 + 2) = 5.2;
    # + 2 = 24.5
    assert "precision: bf16-true (bf16 weights and AdamW state)` -> fsdp: 24.5 GB" in hint
    assert "(formula, a lower bound)" in hint and "(traced)" not in hint


def test_nothing_else_fits_says_so_instead_of_guessing() -> None:
    message = refusal(job({"strategy": "auto", "model_params": 200e9, "batch_size": 1},
                          gpu_model="RTX-A6000"))
    assert "no other layout the planner knows fits either" in message.split("hint:")[1]
    assert "bf16-true" not in message.split("hint:")[1].split("(sharding")[0]


def test_autocasts_copies_do_not_grow_with_the_batch() -> None:
    # traced at world 2, batch 1, bf16-mixed: 17.04 GB of activations at the end of forward, of
    # which 2 x 6.74e9 = 13.48 GB are autocast's copies; at batch 2 the rest doubles
    traced = TracedPeak("fsdp", world_size=2, batch=1, weights=13.48 * GB, gradients=0.4 * GB,
                        optimizer=26.95 * GB, gathered=3.48 * GB, activations=17.04 * GB)
    facts = ModelFacts(params=6.74e9, traced=(traced,))
    p = plan(job({"strategy": "fsdp", "precision": "bf16-mixed", "batch_size": 2},
                 gpu_model="A100-80GB"), model=facts)
    assert p.memory is not None
    row = p.memory.estimates[0]
    assert row.parts["autocast"] == pytest.approx(13.48)
    assert row.parts["activations"] == pytest.approx((17.04 - 13.48) * 2)
    # 2 ranks as traced: 13.48 + 0.4 + 26.95 + 3.48 + 13.48 + 7.12 + 1.5 = 66.41
    assert row.peak_gb == pytest.approx(66.41)
    from orchestrate.cli.tables import decision_line

    line = decision_line(p)
    assert line is not None
    assert line.endswith("the biggest part of its peak: optimizer state, 26.9 GB of 66.4")


def test_the_busiest_moment_is_carried_over_too() -> None:
    # traced at 2 ranks, fp32: the peak is the optimizer step (states), the end of the forward
    # pass holds 8 GB of activations and 0.4 of gradients
    traced = TracedPeak("fsdp", world_size=2, batch=1, weights=13.48 * GB,
                        gradients=12.14 * GB, optimizer=26.95 * GB, gathered=3.48 * GB,
                        activations=1.57 * GB,
                        busiest=(13.48 * GB, 0.4 * GB, 26.95 * GB, 3.48 * GB, 8.0 * GB))
    again = TracedPeak.from_json(json.loads(json.dumps(traced.to_json())))
    assert again == traced
    p = plan(job({"strategy": "fsdp", "batch_size": 1}, allow_mixed_gpus=True),
             model=ModelFacts(params=6.74e9, traced=(traced,)))
    assert p.memory is not None and p.world_size == 8
    row = p.memory.estimates[0]
    # at 8 ranks the shards are a quarter: the optimizer step is
    # (13.48 + 12.14 + 26.95) / 4 + 3.48 + 1.57 + 1.5 = 19.69, the end of the forward pass
    # (13.48 + 0.4 + 26.95) / 4 + 3.48 + 8 + 1.5 = 23.19: the peak there
    assert row.peak_gb == pytest.approx(23.19, abs=0.01)
    assert row.parts["activations"] == pytest.approx(8.0)


@pytest.mark.parametrize(("params", "precision", "layout", "ddp", "chosen"), [
    # N parameters on ambers' 8 GPUs (A6000: 51.54 GB), batch 1, the formula; FSDP's unit is
    # 5% of N: gathered weights 2 x 0.05N and unsharded gradients 2 x 0.05N, 4 bytes each in
    # fp32 (0.8N bytes), 2 in bf16-true (0.4N). The activation allowance: 2 GB, a third under
    # checkpointing; autocast's bf16 copy of every weight: 2N under bf16-mixed without it.
    (6.7e9, "fp32", "fsdp", 16 * 6.7 + 2, 2 * 6.7 + 0.8 * 6.7 + 2),            # 109.2, 20.76
    (6.7e9, "bf16-mixed", "fsdp", 18 * 6.7 + 2, 4.8 * 6.7 + 2),                # 122.6, 34.16
    (6.7e9, "bf16-true", "fsdp", 8 * 6.7 + 2, 1.4 * 6.7 + 2),                  # 55.6, 11.38
    (13e9, "fp32", "fsdp", 16 * 13 + 2, 2.8 * 13 + 2),                         # 210, 38.4
    # fsdp: 2.8N + 2N + 2 = 64.4 > 51.54; with checkpointing no copies: 2.8N + 2/3
    (13e9, "bf16-mixed", "fsdp+ac", 18 * 13 + 2, 2.8 * 13 + 2 / 3),            # 236, 37.07
    (13e9, "bf16-true", "fsdp", 8 * 13 + 2, 1.4 * 13 + 2),                     # 106, 20.2
])
def test_the_notes_models_on_the_mixed_server_by_precision(
        params: float, precision: str, layout: str, ddp: float, chosen: float) -> None:
    p = plan(job({"strategy": "auto", "model_params": params, "batch_size": 1,
                  "precision": precision}, allow_mixed_gpus=True))
    assert p.memory is not None and p.memory.layout == layout and p.world_size == 8
    rows = {(e.strategy, e.gpu_model): e for e in p.memory.estimates}
    assert rows["ddp", "RTX-A6000"].peak_gb == pytest.approx(ddp, abs=0.01)
    assert rows["ddp", "RTX-A6000"].fits is False
    assert rows[layout, "RTX-A6000"].peak_gb == pytest.approx(chosen, abs=0.01)
    assert rows[layout, "RTX-A6000"].fits and rows[layout, "A100-80GB"].fits
