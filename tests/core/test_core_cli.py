"""The inspecting commands as a person uses them: inventory show, validate, plan, render, schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrate.diagnosis.rankpackage import folder as sidecar_folder
from tests.support.corecli import CORE, INVENTORIES, REPO, cli, cli_process, shellcheck, write_yaml

pytestmark = pytest.mark.unit

EXAMPLES = sorted(INVENTORIES.glob("*.yaml"))


def test_the_example_inventories_exist_and_validate() -> None:
    assert {p.name for p in EXAMPLES} >= {"workstation.yaml", "lab.yaml", "cluster.yaml"}
    result = cli("validate", *EXAMPLES)
    assert result.code == 0, result.err
    assert result.out.count(": ok (inventory)") == len(EXAMPLES)


def test_inventory_show_json_of_the_lab() -> None:
    result = cli("inventory", "show", "--json", INVENTORIES / "lab.yaml")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["name"] == "lab"
    nodes = {n["name"]: n for n in data["nodes"]}
    ambers = nodes["ambers"]
    assert [(g["index"], g["model"], g["memory_gb"]) for g in ambers["gpus"]] == [
        (0, "A100-80GB", 80), (1, "A100-80GB", 80),
        *[(i, "RTX-A6000", 48) for i in range(2, 8)],
    ]
    assert ambers["gpu_link"] == "pcie"
    assert ambers["network"]["fabric"] == "ethernet"
    assert ambers["slots"] is None
    for node in data["nodes"]:
        assert {"name", "address", "gpus", "slots", "gpu_link", "network", "partition"} <= set(node)


def test_inventory_show_json_expands_the_clusters_hostlist() -> None:
    data = json.loads(cli("inventory", "show", "--json", INVENTORIES / "cluster.yaml").out)
    assert [n["name"] for n in data["nodes"]] == [f"gpu{i:02d}" for i in range(1, 17)]
    for node in data["nodes"]:
        assert [g["index"] for g in node["gpus"]] == list(range(8))
        assert {g["model"] for g in node["gpus"]} == {"H100-80GB"}
        assert node["gpu_link"] == "nvswitch" and node["partition"] == "gpu"
        assert node["network"]["fabric"] == "infiniband" and node["network"]["hca"]


def test_inventory_show_table_names_cuda_indices() -> None:
    result = cli("inventory", "show", INVENTORIES / "lab.yaml")
    assert result.code == 0, result.err
    assert "ambers" in result.out and "birch" in result.out
    assert "PCI bus order" in result.out
    assert "[2,3,4,5,6,7]" in result.out


def test_plan_table_shows_nodes_ranks_and_env() -> None:
    result = cli("plan", CORE / "jobs" / "uneven-ssh.yaml")
    assert result.code == 0, result.err
    for text in ("world_size 5", "node_rank", "LOCAL_RANK", "cuda:2 = GPU 2", "MASTER_ADDR",
                 "0,1,2"):
        assert text in result.out


@pytest.mark.process
def test_plan_json_through_a_real_process() -> None:
    result = cli_process("plan", "--json", CORE / "jobs" / "mixed-a6000.yaml")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    assert (plan["world_size"], plan["backend"], plan["dist_backend"]) == (6, "ssh", "nccl")
    assert plan["master_addr"] == "ambers.lab.internal"
    assert 20000 <= plan["master_port"] < 32000
    node = plan["nodes"][0]
    assert (node["name"], node["node_rank"], node["nproc"]) == ("ambers", 0, 6)
    assert node["cuda_visible_devices"] == "2,3,4,5,6,7"
    assert node["gpu_models"] == ["RTX-A6000"] * 6
    assert [r["rank"] for r in plan["ranks"]] == list(range(6))
    assert plan["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_plan_json_of_cpu_nodes_has_null_devices() -> None:
    plan = json.loads(cli("plan", "--json", CORE / "jobs" / "cpu-local.yaml").out)
    assert plan["nodes"][0]["cuda_visible_devices"] is None
    assert plan["nodes"][0]["gpu_models"] == []
    assert plan["dist_backend"] == "gloo"


def test_job_id_option_sets_the_id_and_the_derived_port() -> None:
    a = json.loads(cli("plan", "--json", "--job-id", "x-1", CORE / "jobs" / "uneven-ssh.yaml").out)
    b = json.loads(cli("plan", "--json", "--job-id", "x-2", CORE / "jobs" / "uneven-ssh.yaml").out)
    assert a["job_id"] == "x-1" and a["run_dir"] == "/srv/jobs/x-1"
    assert a["master_port"] != b["master_port"]


@pytest.mark.parametrize("kind", ["inventory", "job"])
def test_published_schemas_are_up_to_date(kind: str) -> None:
    """docs/schema/*.json are what `orchestrate schema` prints (regenerate them if this fails:
    orchestrate schema inventory > docs/schema/inventory.schema.json, and the same for job)."""
    result = cli("schema", kind)
    assert result.code == 0
    published = REPO / "docs" / "schema" / f"{kind}.schema.json"
    assert published.read_text() == result.out
    schema = json.loads(result.out)
    assert schema["additionalProperties"] is False  # unknown keys are errors in editors too


@pytest.mark.process
def test_a_job_can_bring_its_own_templates(tmp_path: Path) -> None:
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "node.sh.j2").write_text(
        "#!/usr/bin/env bash\n"
        '{% include "_header.sh.j2" %}\n'
        "set -euo pipefail\n"
        "# site template: {{ node.name|comment }}\n"
        "{% for name, value in plan.env.items() %}export {{ name }}={{ value|q }}\n{% endfor %}"
        "{% for name, value in node.env.items() %}export {{ name }}={{ value|q }}\n{% endfor %}"
        "module load cuda/12\n"
        "cd {{ plan.workdir|q }}\n"
        "export RANK=$(( {{ node.first_rank }} + $1 )) LOCAL_RANK=$1\n"
        'exec{% for arg in node.command %} {{ arg|q }}{% endfor %}\n'
    )
    job = write_yaml(
        tmp_path / "job.yaml",
        {"name": "own", "inventory": str(CORE / "inventories" / "uneven.yaml"), "backend": "ssh",
         "resources": {"nodes": 2}, "command": ["python", "t.py"], "templates_dir": "templates",
         "workdir": "/srv/w", "run_root": "/srv/r"},
    )
    out = tmp_path / "out"
    result = cli("render", job, "-o", out)
    assert result.code == 0, result.err
    script = (out / "launch-beta.sh").read_text()
    assert "# site template: beta" in script and "module load cuda/12" in script
    assert "# Generated by orchestrate" in script  # the built-in partial is still found
    shellcheck(out / "launch-alpha.sh", out / "launch-beta.sh")


def test_render_writes_executable_scripts(tmp_path: Path) -> None:
    result = cli("render", CORE / "jobs" / "uneven-ssh.yaml", "-o", tmp_path)
    assert result.code == 0, result.err
    names = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    # The launch scripts, the SSH hosts' evidence reader and the rank sidecar's folder
    # (docs/hangs.md).
    sidecar = sorted(f"sidecar/{name}" for name in sidecar_folder())
    assert "sidecar/sitecustomize.py" in sidecar
    assert names == ["evidence.py", "launch-alpha.sh", "launch-beta.sh", *sidecar]
    scripts = [tmp_path / n for n in names if n.endswith(".sh")]
    assert all(p.stat().st_mode & 0o111 for p in scripts)
    for path in scripts:
        text = path.read_text()
        assert text.startswith("#!/usr/bin/env bash\n")
        assert "set -euo pipefail" in text and "# Generated by orchestrate" in text


def test_version_and_help() -> None:
    assert cli("--version").out.strip().endswith("0.1.0")
    result = cli("--help")
    assert result.code == 0
    for command in ("validate", "plan", "render", "inventory", "schema"):
        assert command in result.out


@pytest.mark.process
def test_a_bad_set_value_is_blamed_on_set_not_on_a_file_line() -> None:
    import subprocess
    import sys
    from pathlib import Path

    job = Path(__file__).resolve().parents[2] / "examples" / "digits" / "job.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrate", "plan", str(job), "--set", "resources.nodes=x"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --set: resources.nodes: ")
    assert "(got 'x')" in proc.stderr and "Traceback" not in proc.stderr


def test_set_values_are_read_as_the_same_text_in_the_file_would_be() -> None:
    """``--set resources.time=4:00:00`` is four hours, as in the file (YAML 1.1 made it the
    base-60 number 14400, which a time limit reads as minutes: ten days)."""
    job = CORE / "jobs" / "cpu-local.yaml"
    result = cli("plan", "--json", job, "--set", "resources.time=4:00:00",
                 "--set", "env.MODE=on", "--set", "command=[python, '-c']")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    assert plan["time_limit"] == "4:00:00"
    assert plan["env"]["MODE"] == "on"
    assert plan["command"] == ["python", "-c"]


def test_validate_reads_a_file_by_its_shape_and_names_the_stray_key(tmp_path: Path) -> None:
    """An inventory with one stray job key is checked as an inventory (one problem: that key),
    not as a job (``defaults: unknown key``, ``nodes: did you mean resources.nodes``)."""
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("name: lab\nenv: {NCCL_DEBUG: INFO}\nnodes:\n  - {name: a, slots: 2}\n"
                         "defaults: {cpus: 8}\n")
    result = cli("validate", inventory)
    assert result.code == 2
    errors = [line for line in result.err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {inventory}:2: env: unknown key"], result.err
    assert "resources.nodes" not in result.err
    inventory.write_text("name: lab\nnodes:\n  - {name: a, slots: 2}\n")
    assert cli("validate", inventory).out == f"{inventory}: ok (inventory)\n"
