"""The framework probes of examples/frameworks, as the tests run and judge them.

Each probe rank prints ``probe {...}``: what its framework believes next
to the variables orchestrate set, a checked all-reduce, whether the DDP replicas agree after a
few steps, and its process (pid, parent command, children). The tests hold that against the
plan of ``orchestrate plan --json``.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "frameworks"
PROBES = ("fabric", "trainer", "accelerate")
FRAMEWORK = {"fabric": "lightning-fabric", "trainer": "lightning-trainer",
             "accelerate": "accelerate"}
#: The steps every probe trains (STEPS in the probes).
STEPS = 4


def copy_probes(work: Path) -> None:
    """The probes and their shared report module, next to the test's job files."""
    for name in (*(f"{p}_probe.py" for p in PROBES), "report.py"):
        shutil.copy(EXAMPLES / name, work / name)


def job_text(probe: str, name: str, backend: str, resources: str, inventory: str | None = None,
             ) -> str:
    """A probe job like the examples' (examples/frameworks/<probe>.yaml)."""
    return textwrap.dedent(f"""\
        name: {name}
        backend: {backend}
        {"inventory: " + inventory if inventory else ""}
        framework: {FRAMEWORK[probe]}
        resources: {resources}
        command: [python, {probe}_probe.py]
        distributed: {{timeout_s: 120}}
        """)


def probe_lines(output: str) -> list[tuple[str, dict[str, Any]]]:
    """``(prefix, record)`` for every probe line in a merged log or ``--follow`` output; the
    prefix is ``[node:rank]`` (empty in a rank's own log)."""
    found = []
    for line in output.splitlines():
        prefix, sep, rest = line.partition("probe {")
        if sep and (prefix == "" or prefix.endswith("] ")):
            found.append((prefix.strip(), json.loads("{" + rest)))
    return found


def assert_believes_plan(output: str, plan: dict[str, Any], probe: str, environment: str,
                         launcher: str, on_hosts: bool = True) -> dict[int, dict[str, Any]]:
    """Every rank of ``plan`` printed exactly one probe line, from its own process, on its plan
    node's host (unless not ``on_hosts``), and its framework believes what the plan says;
    returns the records by rank.

    ``environment`` is the Lightning cluster environment expected (ignored for accelerate);
    ``launcher`` a word of the parent command that shows orchestrate started the rank.
    """
    lines = probe_lines(output)
    world = plan["world_size"]
    assert Counter(r["env"]["RANK"] for _, r in lines) == Counter(str(r) for r in range(world)), (
        "not one probe line per rank:\n" + output[-4000:])
    by_rank = {int(r["env"]["RANK"]): (prefix, r) for prefix, r in lines}
    nodes = {n["name"]: n for n in plan["nodes"]}
    for entry in plan["ranks"]:
        prefix, record = by_rank[entry["rank"]]
        believes, env, checks = record["believes"], record["env"], record["checks"]
        assert record["probe"] == probe
        if prefix:
            assert prefix == f"[{entry['node']}:{entry['rank']}]"
        if on_hosts:  # ran on that machine, not just labelled so
            assert record["process"]["host"] == entry["node"], record
        # What orchestrate set: the plan's rank, local rank, node rank, sizes.
        assert env["RANK"] == str(entry["rank"])
        assert env["LOCAL_RANK"] == str(entry["local_rank"])
        assert env["GROUP_RANK"] == str(entry["node_rank"])
        assert env["WORLD_SIZE"] == str(world)
        assert env["LOCAL_WORLD_SIZE"] == str(nodes[entry["node"]]["nproc"])
        # What the framework believes: the same.
        expected = {
            "global_rank": entry["rank"],
            "local_rank": entry["local_rank"],
            "node_rank": None if probe == "accelerate" else entry["node_rank"],
            "world_size": world,
        }
        assert {k: believes[k] for k in expected} == expected, (entry, record)
        if probe == "accelerate":
            kind = "MULTI_CPU" if plan["dist_backend"] == "gloo" else "MULTI_GPU"
            assert believes["distributed_type"] == f"DistributedType.{kind}", record
        else:
            assert believes["cluster_environment"] == environment, record
            assert checks["sampler"] == [world, entry["rank"]], record
        # One process group of the whole world, and DDP kept the replicas equal.
        assert checks["all_reduce"] == checks["expected"] == world * (world + 1) / 2, record
        assert checks["replicas_agree"] is True, record
        assert checks["steps"] == STEPS, record
    # No process of the framework's own: every rank a distinct process that orchestrate
    # started, none with children.
    records = [r for _, r in by_rank.values()]
    assert len({r["process"]["pid"] for r in records}) == world
    for record in records:
        process = record["process"]
        assert process["children"] == [], record
        parent = " ".join(process["parent"])
        assert launcher in parent and "_probe.py" not in parent, record
    return {rank: record for rank, (_, record) in by_rank.items()}
