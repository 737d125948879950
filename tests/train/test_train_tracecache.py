"""The trace cache: ``plan`` then ``submit`` of one job trace once (issue #34), safely kept in
the user's own state directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrate.train import tracecache

pytestmark = pytest.mark.unit

TRAIN = {"model": "net:build", "model_args": {"width": 8}, "dataset": "net:data"}
ASKED = [{"trace": "fsdp", "world": 2, "batch": 4}]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


def test_the_key_follows_the_model_its_arguments_the_layouts_and_its_source(tmp_path: Path
                                                                            ) -> None:
    (tmp_path / "net.py").write_text("def build(): ...\n")
    first = tracecache.key(TRAIN, ASKED, tmp_path)
    assert first is not None and first == tracecache.key(TRAIN, ASKED, tmp_path)
    assert first != tracecache.key({**TRAIN, "model_args": {"width": 9}}, ASKED, tmp_path)
    assert first != tracecache.key(TRAIN, [{**ASKED[0], "trace": "fsdp+ac"}], tmp_path)
    assert first == tracecache.key({**TRAIN, "memory_trace_s": 900, "epochs": 3}, ASKED, tmp_path)
    (tmp_path / "net.py").write_text("def build(): return 1\n")
    assert first != tracecache.key(TRAIN, ASKED, tmp_path)


def test_answers_round_trip_in_a_private_folder(home: Path) -> None:
    tracecache.save("k1", ['{"facts": {}}', '{"traced": {}}'])
    assert tracecache.load("k1") == ['{"facts": {}}', '{"traced": {}}']
    folder = home / "traces"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "k1.json").stat().st_mode & 0o777 == 0o600
    assert tracecache.load("k2") is None


def test_links_open_folders_and_junk_are_misses(home: Path, tmp_path: Path) -> None:
    tracecache.save("k1", ["x"])
    folder = home / "traces"
    (tmp_path / "elsewhere.json").write_text('["planted"]')
    os.symlink(tmp_path / "elsewhere.json", folder / "k2.json")
    assert tracecache.load("k2") is None
    (folder / "k3.json").write_text("not json")
    assert tracecache.load("k3") is None
    folder.chmod(0o770)
    assert tracecache.load("k1") is None
    tracecache.save("k4", ["y"])  # nothing written into a folder others may write
    assert not (folder / "k4.json").exists()
