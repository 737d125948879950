"""``validate``/``plan``/``submit`` refuse ``train.model``/``dataset``/``loss`` paths that do not
resolve from the workdir, with the job file's line and a did-you-mean (issue #33 item 3); the
module is read, never run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from orchestrate.core.errors import UserError
from orchestrate.core.spec.trainspec import TrainSpec
from orchestrate.run.prepare import load
from orchestrate.train.importcheck import check, scan

pytestmark = pytest.mark.unit

MODULE = """
import os
from collections import OrderedDict as Ordered

RAN = open(os.path.join(os.path.dirname(__file__), "ran"), "w")  # proof it never runs


def build_model(hidden=4):
    return None


class Data:
    pass


build_dataset = Data
"""


def _workdir(tmp_path: Path) -> Path:
    (tmp_path / "mymodels.py").write_text(MODULE)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('never imported')\n")
    (tmp_path / "pkg" / "nets.py").write_text("def resnet():\n    pass\n")
    (tmp_path / "pkg" / "star.py").write_text("from os.path import *\n")
    return tmp_path


def test_paths_that_resolve_pass_and_nothing_runs(tmp_path: Path) -> None:
    search = [str(_workdir(tmp_path))]
    for path in ("mymodels:build_model", "mymodels:Data", "mymodels:build_dataset",
                 "mymodels:Ordered", "pkg.nets:resnet", "pkg.star:anything", "os.path:join"):
        assert scan(path, [*search, "/nonexistent", *sys.path]) is None, path
    assert not (tmp_path / "ran").exists()


def test_a_typo_says_what_is_missing_with_a_did_you_mean(tmp_path: Path) -> None:
    search = [str(_workdir(tmp_path))]
    found = scan("mymodels:build_modle", search)
    assert found is not None and "has no 'build_modle'" in found["message"]
    assert "did you mean 'build_model'?" in found["hint"]
    module = scan("mymodel:build_model", search)
    assert module is not None and module["missing"] == "module"
    assert "module 'mymodel' not found" in module["message"]
    assert "did you mean 'mymodels'?" in module["hint"]
    sub = scan("pkg.net:resnet", search)
    assert sub is not None and "not found in package pkg" in sub["message"]


def test_a_module_missing_here_is_a_note_when_the_ranks_run_elsewhere(tmp_path: Path) -> None:
    train = TrainSpec.model_validate({"model": "nosuchmod:f", "dataset": "mymodels:nope",
                                      "loss": "mse"})
    lines = {("train", "model"): 5, ("train", "dataset"): 6}
    problems, notes = check(train, _workdir(tmp_path), "job.yaml", lines, (), elsewhere=True)
    assert [p.render().splitlines()[0] for p in problems] == [
        "job.yaml:6: train.dataset: dataset factory mymodels "
        f"({tmp_path / 'mymodels.py'}) has no 'nope' (got mymodels:nope)"]
    assert notes == ["train.model: module 'nosuchmod' not found in the job's workdir and the "
                     "Python path here; the nodes must have it"]
    problems, _ = check(train, tmp_path, "job.yaml", lines, ("train.model=nosuchmod:f",),
                        elsewhere=False)
    assert problems[0].source == "--set" and problems[0].line is None


def test_load_refuses_a_typo_in_model_naming_the_line(tmp_path: Path) -> None:
    _workdir(tmp_path)
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(json.dumps({"name": "one", "nodes": [
        {"name": "h1", "address": "198.18.0.1", "slots": 2}]}))
    job = tmp_path / "job.yaml"
    job.write_text("name: typo\nbackend: ssh\ninventory: inv.yaml\n"
                   "resources: {nodes: 1, gpus_per_node: 2}\ntrain:\n"
                   "  model: mymodels:build_modle\n  dataset: mymodels:build_dataset\n")
    with pytest.raises(UserError) as caught:
        load(job)
    text = str(caught.value)
    assert text.startswith(f"{job}:6: train.model: model factory mymodels"), text
    assert "did you mean 'build_model'?" in text
