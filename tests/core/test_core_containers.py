"""The job's ``container:`` section and the planner's per-node container decisions (pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrate.core.errors import UserError
from orchestrate.core.plan.container import ContainerPlan
from orchestrate.core.plan.plan import Occupancy, Plan, make_plan
from orchestrate.core.spec.inventory import Inventory, InventorySpec, resolve_inventory
from orchestrate.core.spec.job import JobSpec
from tests.support.corecli import cli, write_yaml

pytestmark = pytest.mark.unit

IB = {"fabric": "infiniband", "interface": "ib0"}


def inventory(*nodes: dict[str, Any]) -> Inventory:
    return resolve_inventory(InventorySpec.model_validate({"name": "t", "nodes": list(nodes)}))


def gpu_node(name: str, count: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "gpus": [{"model": "A100-80GB", "memory_gb": 80, "count": count}],
            **extra}


def job(container: dict[str, Any], **fields: Any) -> JobSpec:
    base: dict[str, Any] = {"name": "j", "backend": "ssh", "command": ["python", "train.py"],
                            "container": {"image": "reg.io/org/train:2.13", **container}}
    return JobSpec.model_validate(base | fields)


def plan(spec: JobSpec, inv: Inventory, **kw: Any) -> Plan:
    return make_plan(spec, inv, job_id="j-1", run_dir="/runs/j-1", workdir="/work", **kw)


def box(p: Plan, node: int = 0) -> ContainerPlan:
    container = p.nodes[node].container
    assert container is not None
    return container


def refusal(spec: JobSpec, inv: Inventory, **kw: Any) -> str:
    with pytest.raises(UserError) as caught:
        plan(spec, inv, **kw)
    return caught.value.problems[0].render()


def test_podman_on_an_infiniband_gpu_node_gets_what_nccl_needs() -> None:
    p = plan(job({"runtime": "podman"}, resources={"nodes": 1, "gpus_per_node": 2}),
             inventory(gpu_node("a", 4, network=IB)))
    c = box(p)
    assert c.name == "orchestrate-j-1-a"
    assert {"--network=host", "--ipc=host", "--ulimit=memlock=-1:-1",
            "--device=/dev/infiniband", "--cap-add=IPC_LOCK"} <= set(c.start)
    assert not any(a.startswith("--shm-size") for a in c.start)  # never with --ipc=host
    assert [a for a in c.start if a.startswith("--device=nvidia")] == [
        "--device=nvidia.com/gpu=0", "--device=nvidia.com/gpu=1"]
    assert "--volume=/runs/j-1:/runs/j-1" in c.start and "--volume=/work:/work" in c.start
    # The same GPUs inside, as the container numbers them; the job tag and the plan's env.
    assert "--env=CUDA_VISIBLE_DEVICES=0,1" in c.enter
    assert "--env=ORCHESTRATE_JOB_ID=j-1" in c.enter
    assert {"--env=MASTER_ADDR", "--env=MASTER_PORT", "--env=WORLD_SIZE", "--env=RANK",
            "--env=LOCAL_RANK"} <= set(c.enter)
    assert c.remove[:3] == ("podman", "rm", "--force")


def test_a_node_without_infiniband_gets_no_memlock_or_devices() -> None:
    c = box(plan(job({"runtime": "podman"}), inventory(gpu_node("a", 2))))
    assert not any("memlock" in a or "infiniband" in a for a in c.start)


def test_private_ipc_sizes_shm_from_the_node_ranks_and_drops_host_ipc() -> None:
    c = box(plan(job({"runtime": "podman", "ipc": "private"},
                     resources={"nodes": 1, "gpus_per_node": 3}), inventory(gpu_node("a", 4))))
    assert "--shm-size=3g" in c.start and "--ipc=host" not in c.start
    c = box(plan(job({"runtime": "podman", "ipc": "private", "shm_size": "16g"}),
                 inventory(gpu_node("a", 2))))
    assert "--shm-size=16g" in c.start


def test_docker_gets_the_planned_gpus_with_gpus() -> None:
    inv = inventory({"name": "a", "gpus": [{"model": "A100-80GB", "memory_gb": 80,
                                            "indices": [2, 3]}]})
    c = box(plan(job({"runtime": "docker"}), inv))
    assert c.start[c.start.index("--gpus") + 1] == '"device=2,3"'


def test_the_runtime_defaults_to_what_the_node_has() -> None:
    c = box(plan(job({}), inventory(gpu_node("a", 2, containers=["docker"]))))
    assert c.runtime == "docker"
    found = Occupancy(runtimes={"a": ("podman",)})
    assert box(plan(job({}), inventory(gpu_node("a", 2)), occupancy=found)).runtime == "podman"


def test_a_runtime_the_node_lacks_is_refused_before_launch() -> None:
    text = refusal(job({"runtime": "podman"}), inventory(gpu_node("a", 2, containers=["docker"])))
    assert "container.runtime" in text and "node a has no podman" in text
    text = refusal(job({}), inventory(gpu_node("a", 2, containers=[])))
    assert "no container runtime" in text


def test_slurm_runtimes_are_refused_on_bare_servers() -> None:
    text = refusal(job({"runtime": "pyxis"}), inventory(gpu_node("a", 2)))
    assert "pyxis does not run on the ssh backend" in text and "backend: slurm" in text


def test_pyxis_lists_every_variable_the_plan_sets_in_container_env() -> None:
    p = plan(job({}, backend="slurm", resources={"nodes": 2, "gpus_per_node": 2}),
             inventory(gpu_node("a", 2), gpu_node("b", 2)))
    c = box(p)
    assert c.runtime == "pyxis"
    assert "--container-image=reg.io#org/train:2.13" in c.start  # enroot's REGISTRY#IMAGE
    (env,) = [a for a in c.start if a.startswith("--container-env=")]
    names = env.split("=", 1)[1].split(",")
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                 "ORCHESTRATE_JOB_ID", *p.env):
        assert name in names, name
    assert "--container-mounts=/runs/j-1:/runs/j-1,/work:/work" in c.start


def test_apptainer_binds_and_passes_gpus() -> None:
    c = box(plan(job({"runtime": "apptainer", "mounts": ["/data:/data:ro"]}, backend="slurm"),
                 inventory(gpu_node("a", 2))))
    assert c.start[:3] == ("apptainer", "exec", "--nv")
    assert "--bind=/runs/j-1:/runs/j-1,/work:/work,/data:/data:ro" in c.start
    assert c.start[-1] == "docker://reg.io/org/train:2.13"


def test_image_files_the_runtime_cannot_run_are_refused() -> None:
    text = refusal(job({"runtime": "podman", "image": "/img/train.sqsh"}),
                   inventory(gpu_node("a", 2)))
    assert "container.image" in text and "runtime: pyxis" in text


def test_a_mount_over_the_workdir_is_refused() -> None:
    text = refusal(job({"runtime": "podman", "mounts": ["/elsewhere:/work"]}),
                   inventory(gpu_node("a", 2)))
    assert "container.mounts.0" in text and "workdir" in text


def test_the_plan_round_trips_through_json() -> None:
    p = plan(job({"runtime": "podman"}), inventory(gpu_node("a", 2, network=IB)))
    assert Plan.from_json(p.to_json()) == p


@pytest.mark.parametrize(("section", "problem"), [
    ({"ipc": "host", "shm_size": "16g"}, "shm_size needs ipc: private"),
    ({"mounts": ["data:/data"]}, "is not an absolute path"),
    ({"mounts": ["/a:/d", "/b:/d"]}, "both mount on /d"),
    ({"mounts": ["/a:/d:rx"]}, "the mode is ro or rw"),
    ({"env": ["not-a-name"]}, "is not an environment variable name"),
    ({"image": "--privileged"}, "cannot start with '-'"),
])
def test_bad_container_sections_are_user_errors_with_the_line(
        tmp_path: Path, section: dict[str, Any], problem: str) -> None:
    inv = write_yaml(tmp_path / "inv.yaml", {"name": "t", "nodes": [gpu_node("a", 2)]})
    path = write_yaml(tmp_path / "job.yaml", {
        "name": "j", "inventory": str(inv), "backend": "ssh", "command": ["python", "t.py"],
        "container": {"image": "img:1", **section}})
    result = cli("plan", path)
    assert result.code == 2, result.out + result.err
    assert "job.yaml:" in result.err and "container." in result.err
    assert problem in result.err
    assert "Traceback" not in result.err


# ---------------------------------------------------------------- goldens vs documented flags

#: pyxis's options (NVIDIA/pyxis args.c, as /work/shared/reference/containers.md lists them).
PYXIS_FLAGS = {"--container-image", "--container-mounts", "--container-workdir",
               "--container-name", "--container-save", "--container-mount-home",
               "--no-container-mount-home", "--container-remap-root",
               "--no-container-remap-root", "--container-entrypoint",
               "--no-container-entrypoint", "--container-entrypoint-log",
               "--container-writable", "--container-readonly", "--container-env"}
#: apptainer exec's options used here (apptainer-exec man page): --nv, -B/--bind, --pwd.
APPTAINER_FLAGS = {"--nv", "--bind", "--pwd"}
GOLDEN = Path(__file__).parent / "golden"


def _words(line: str) -> list[str]:
    import shlex
    return shlex.split(line.rstrip("\\ \n"))


def test_the_pyxis_golden_uses_only_documented_flags_on_srun() -> None:
    text = (GOLDEN / "container-pyxis.render.txt").read_text()
    (line,) = [ln for ln in text.splitlines() if "--container-image=" in ln]
    words = _words(line)
    assert {w.split("=", 1)[0] for w in words} <= PYXIS_FLAGS
    flags = dict(w.split("=", 1) for w in words)
    assert flags["--container-image"] == "nvcr.io#nvidia/pytorch:25.08-py3"
    assert flags["--container-mounts"].split(",")[-1] == "/data:/data:ro"
    env = flags["--container-env"].split(",")
    assert {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "HF_HOME", "ORCHESTRATE_JOB_ID"} <= set(env)
    # The container wraps the srun of every rank, and no enroot hook sets the port.
    assert "MASTER_PORT=$((" in text and "SLURM_JOB_ID % 4536" not in text


def test_the_apptainer_golden_uses_only_documented_flags() -> None:
    text = (GOLDEN / "container-apptainer.render.txt").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("apptainer exec")]
    words = _words(line.split(' "$@"')[0])
    assert words[:2] == ["apptainer", "exec"] and words[-1] == "/images/train.sif"
    assert {w.split("=", 1)[0] for w in words[2:-1]} <= APPTAINER_FLAGS
    assert 'export "APPTAINERENV_$name=${!name}"' in text


def test_the_podman_golden_never_has_host_ipc_and_shm_size_together() -> None:
    text = (GOLDEN / "container-podman-ssh.render.txt").read_text()
    assert "  --ipc=host\n" in text and "--shm-size" not in text
    assert "  --ulimit=memlock=-1:-1\n" in text and "  --device=/dev/infiniband\n" in text
    assert "  --device=nvidia.com/gpu=0\n  --device=nvidia.com/gpu=1\n" in text
    assert "  --env=CUDA_VISIBLE_DEVICES=0,1\n" in text


def test_plan_shows_the_image_and_runtime_per_node() -> None:
    from tests.support.corecli import CORE

    result = cli("plan", CORE / "jobs" / "container-podman-ssh.yaml")
    assert result.code == 0, result.err
    rows = [ln for ln in result.out.splitlines() if "podman registry.lab/train:2.13" in ln]
    assert len(rows) == 2 and "node1" in rows[0] and "node2" in rows[1]
    plain = cli("plan", CORE / "jobs" / "uniform-ssh.yaml")
    assert "container" not in plain.out  # a job without one shows no such column
