"""A supervisor claims the submitted plan with the facts ``submit`` sent, not the job's models.

What a user would check: a job handed to its supervisor leases in the inventory's book, on the
GPUs it wants, waits as ``resources.wait`` says and keeps ``loaded.json`` as before, whether the
supervisor decoded the job or only read the facts the CLI computed (orchestrate/run/loaded.py);
a re-planned job answers from the job itself. Pure: no process, no socket.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from orchestrate.backends.handshake import Handshake
from orchestrate.backends.local.backend import LocalBackend
from orchestrate.backends.sharing import lease_books, lease_dir, node_claim, wait_limit, wants
from orchestrate.core.render.render import render_template
from orchestrate.run.loaded import Prepared
from orchestrate.run.prepare import prepare

pytestmark = pytest.mark.unit


def _submitted(tmp_path: Path, wait: str | None) -> Prepared:
    """A waiting (or not) 2-GPU job on an inventory of two GPU models and its own book."""
    (tmp_path / "inv.yaml").write_text(textwrap.dedent(f"""
        name: lab
        nodes:
          - name: localhost
            address: 127.0.0.1
            lease_dir: {tmp_path / 'book'}
            gpus:
              - {{model: A100-80GB, memory_gb: 80, indices: [0, 1]}}
              - {{model: L4, memory_gb: 24, indices: [2, 3]}}
        """))
    (tmp_path / "job.yaml").write_text(textwrap.dedent("""
        name: facts
        inventory: inv.yaml
        resources: {nodes: 1, gpus_per_node: 2}
        command: [python, train.py]
        """))
    overrides = () if wait is None else (f"resources.wait={wait}",)
    return prepare(tmp_path / "job.yaml", overrides, id_suffix="f00d01")


def _handed_over(prepared: Prepared) -> Prepared:
    """What the supervisor makes of its handshake, through the pipe (JSON and back)."""
    sent = LocalBackend().handshake(prepared, None)
    got = Handshake.from_json(json.loads(json.dumps(sent.to_json())))
    assert got == sent
    return Prepared(got.loaded, got.plan, got.facts)


@pytest.mark.parametrize("wait", [None, "'01:30'"])
def test_the_facts_answer_what_the_decoded_job_answers(tmp_path: Path, wait: str | None
                                                       ) -> None:
    submitted = _submitted(tmp_path, wait)
    handed = _handed_over(submitted)
    node = handed.plan.nodes[0]
    assert handed.facts is not None and not handed.decoded
    assert lease_dir(handed, node.name) == str(tmp_path / "book")
    assert lease_books(handed) == {node.name: str(tmp_path / "book")}
    assert wait_limit(handed) == (None if wait is None else 90.0)
    assert wants(handed, node) == wants(submitted, node)
    assert node_claim(handed, node).is_gpu and node_claim(handed, node).gpus == (0, 1, 2, 3)
    assert handed.path == submitted.path and handed.templates_dir == submitted.templates_dir
    # loaded.json as before: the JSON it came as is what decoding and encoding again gives
    assert handed.loaded_json() == json.loads(json.dumps(submitted.loaded.to_json()))
    assert not handed.decoded, "claiming read no spec model"
    # ... and the same answers from the job itself, once something decodes it
    decoded = Prepared(handed.loaded, handed.plan)
    assert handed.decoded and decoded.facts is None
    assert lease_dir(decoded, node.name) == lease_dir(handed, node.name)
    assert wait_limit(decoded) == wait_limit(handed)
    assert wants(decoded, node) == wants(handed, node)
    assert node_claim(decoded, node) == node_claim(handed, node)


def test_a_replanned_job_carries_no_facts_of_the_old_plan(tmp_path: Path) -> None:
    handed = _handed_over(_submitted(tmp_path, None))
    again = handed.with_plan(handed.plan)
    assert again.facts is None
    assert again.loaded_json() == handed.loaded_json()


def test_a_handshake_without_facts_reads_as_before(tmp_path: Path) -> None:
    """A handshake line written without ``facts`` (an older CLI) still reads."""
    sent = LocalBackend().handshake(_submitted(tmp_path, None), None).to_json()
    del sent["facts"]
    got = Handshake.from_json(json.loads(json.dumps(sent)))
    assert got.facts is None
    handed = Prepared(got.loaded, got.plan, got.facts)
    assert wait_limit(handed) is None and handed.decoded


def test_an_edited_template_renders_anew_in_the_same_process(tmp_path: Path) -> None:
    """The template environments are kept per folder: an edit is still seen (mtime)."""
    folder = tmp_path / "templates"
    folder.mkdir()
    template = folder / "note.j2"
    template.write_text("one {{ x }}\n")
    values: dict[str, Any] = {"x": 1}
    assert render_template("note.j2", values, folder) == "one 1\n"
    template.write_text("two {{ x }}\n")
    later = template.stat().st_mtime + 5
    os.utime(template, (later, later))
    assert render_template("note.j2", values, folder) == "two 1\n"
