"""Rendered scripts, executed: what a rank receives is exactly what the plan says.

A stub program stands in for the training script: it prints its argv, working directory and
environment as JSON. The launch scripts are run with bash like a backend runs them
(``bash launch-<node>.sh LOCAL_RANK``), in a clean environment, so every variable the stub sees
came from the script.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrate.backends import rendered
from orchestrate.run.prepare import Prepared, prepare
from tests.support.corecli import TEST_INVENTORIES, shellcheck, write_yaml

pytestmark = pytest.mark.process

#: Values a path, an env value or an argument may carry, each a classic injection or quoting bug.
HOSTILE = [
    "two words",
    "it's",
    'say "hi"',
    "$(touch pwned-subst)",
    "`touch pwned-backtick`",
    "a; touch pwned-semicolon",
    "x && touch pwned-and | cat",
    "line one\nline two",
    "back\\slash \\n",
    "$HOME ${HOME} $1 $@",
    "*",
    "-n",
    "--",
    "",
    "tab\there",
    "#not a comment",
    "~",
    "ünïcödé ✓",
]

STUB = """#!{python}
import json, os, sys
print(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}))
"""

#: What bash and Python add to a clean environment by themselves.
SHELL_NOISE = {"PWD", "OLDPWD", "SHLVL", "_", "LC_CTYPE"}
BASE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent-home"}


def make_stub(folder: Path) -> Path:
    stub = folder / "stub-interpreter"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    return stub


def run_script(
    script: Path, local_rank: int, cwd: Path, stdin: str = ""
) -> dict[str, Any]:
    proc = subprocess.run(
        ["bash", str(script), str(local_rank)],
        cwd=cwd,
        env=BASE_ENV,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, f"{script.name} {local_rank}: {proc.stderr}"
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def written(prepared: Prepared, folder: Path) -> dict[str, Path]:
    """The rendered files as a backend writes them: in the user's own 0700 folders (job.sbatch
    checks its run directory again before anything runs from it)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    paths = {}
    for name, text in rendered(prepared).items():
        path = folder / name
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        paths[name] = path
    return paths


def script_env(seen: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in seen.items() if k not in SHELL_NOISE and k not in BASE_ENV}


def no_injection(*folders: Path) -> None:
    for folder in folders:
        leaked = sorted(p.name for p in folder.rglob("pwned*"))
        assert not leaked, f"a value ran as a command: {leaked}"


def _hostile_job(tmp_path: Path, backend: str) -> tuple[Path, Path, Path]:
    """A job whose workdir, run_root, env and command carry every hostile value."""
    workdir = tmp_path / "work dir 'q' \"dq\" $(touch pwned-w) `x` ; y\nz"
    workdir.mkdir()
    stub = make_stub(tmp_path)
    nodes = [{"name": "h1", "address": "127.0.0.1", "slots": 2}]
    if backend == "ssh":
        nodes.append({"name": "h2", "address": "127.0.0.1", "slots": 1})
    inventory = write_yaml(
        tmp_path / "inventory.yaml",
        {"name": "hostile", "defaults": {"python": str(stub)}, "nodes": nodes},
    )
    job = write_yaml(
        tmp_path / "job.yaml",
        {
            "name": "hostile",
            "inventory": str(inventory),
            "backend": backend,
            "resources": {"nodes": len(nodes)},
            "command": ["python", *HOSTILE],
            "workdir": str(workdir),
            "run_root": str(tmp_path / "runs $(touch pwned-r) ';\n"),
            "env": {f"HOSTILE_{i}": value for i, value in enumerate(HOSTILE)},
            "secret_env": ["API_TOKEN"],
        },
    )
    return job, workdir, tmp_path


@pytest.fixture()
def hostile_job(tmp_path: Path) -> tuple[Path, Path, Path]:
    return _hostile_job(tmp_path, "ssh")


@pytest.mark.parametrize("backend", ["ssh", "local"])
def test_hostile_values_reach_the_program_literally(tmp_path: Path, backend: str) -> None:
    job, workdir, root = _hostile_job(tmp_path, backend)
    prepared = prepare(job)
    files = written(prepared, root / "scripts")
    shellcheck(*(path for name, path in files.items() if name.endswith(".sh")))
    secret = "s3cr3t 'with' $(touch pwned-secret) \"quotes\""
    for node in prepared.plan.nodes:
        for rank in node.ranks:
            seen = run_script(
                files[f"launch-{node.name}.sh"], rank.local_rank, root, secret + "\n"
            )
            assert seen["argv"] == HOSTILE
            assert seen["cwd"] == str(workdir)
            env = seen["env"]
            for i, value in enumerate(HOSTILE):
                assert env[f"HOSTILE_{i}"] == value
            assert env["ORCHESTRATE_RUN_DIR"] == prepared.plan.run_dir
            assert "\n" in env["ORCHESTRATE_RUN_DIR"]
            assert env["API_TOKEN"] == secret
            assert env["RANK"] == str(rank.rank)
    no_injection(root)


@pytest.mark.unit
def test_a_secret_is_never_written_into_a_script(hostile_job: tuple[Path, Path, Path]) -> None:
    job, _, _ = hostile_job
    for name, text in rendered(prepare(job)).items():
        if name.endswith(".sh"):
            assert "API_TOKEN" in text  # named, read from stdin ...
        assert "s3cr3t" not in text  # ... never its value, in any file


def test_a_missing_secret_stops_the_rank(hostile_job: tuple[Path, Path, Path]) -> None:
    job, _, root = hostile_job
    prepared = prepare(job)
    script = written(prepared, root / "scripts")["launch-h1.sh"]
    proc = subprocess.run(
        ["bash", str(script), "0"], env=BASE_ENV, input="", capture_output=True, text=True,
        timeout=30, check=False,
    )
    assert proc.returncode == 2
    assert "secret API_TOKEN missing on stdin" in proc.stderr


def test_an_unknown_local_rank_is_refused(hostile_job: tuple[Path, Path, Path]) -> None:
    job, _, root = hostile_job
    script = written(prepare(job), root / "scripts")["launch-h2.sh"]
    for arg in (["1"], ["x"], []):
        proc = subprocess.run(
            ["bash", str(script), *arg], env=BASE_ENV, input="tok\n", capture_output=True,
            text=True, timeout=30, check=False,
        )
        assert proc.returncode == 2, arg
        assert "usage:" in proc.stderr


def _env_job(tmp_path: Path, inventory: Path, backend: str, **resources: Any) -> Path:
    """A copy of a test inventory whose nodes run the stub interpreter as 'python'."""
    import yaml

    data = yaml.safe_load(inventory.read_text())
    data.setdefault("defaults", {})["python"] = str(make_stub(tmp_path))
    inv = write_yaml(tmp_path / inventory.name, data)
    (tmp_path / "work").mkdir(exist_ok=True)
    return write_yaml(
        tmp_path / "job.yaml",
        {
            "name": "envcheck",
            "inventory": str(inv),
            "backend": backend,
            "resources": resources,
            "command": ["python", "train.py", "--flag"],
            "workdir": str(tmp_path / "work"),
            "run_root": str(tmp_path / "runs"),
            "env": {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": 3},
        },
    )


ENV_CASES = {
    "uniform-ssh": ("uniform.yaml", "ssh", {"nodes": 2}),
    "uneven-ssh": ("uneven.yaml", "ssh", {"nodes": 2}),
    "subset-ssh": ("uneven.yaml", "ssh", {"nodes": 1, "gpus_per_node": 2}),
    "cpu-ssh": ("cpu.yaml", "ssh", {"nodes": 2, "gpus_per_node": 3}),
    "cpu-local": ("localhost-cpu.yaml", "local", {}),
}


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_every_rank_gets_exactly_the_plans_env(tmp_path: Path, case: str) -> None:
    inventory, backend, resources = ENV_CASES[case]
    job = _env_job(tmp_path, TEST_INVENTORIES / inventory, backend, **resources)
    prepared = prepare(job)
    plan = prepared.plan
    files = written(prepared, tmp_path / "scripts")
    assert {n for n in files if n.endswith(".sh")} == {f"launch-{n.name}.sh" for n in plan.nodes}
    # Beyond the plan's env, the script puts the rank sidecar first on the inherited PYTHONPATH
    # (there is none here).
    sidecar = {"PYTHONPATH": f"{plan.run_dir}/sidecar"}
    seen_ranks = []
    for node in plan.nodes:
        for rank in node.ranks:
            seen = run_script(files[f"launch-{node.name}.sh"], rank.local_rank, tmp_path)
            assert script_env(seen["env"]) == node.rank_env(rank, plan.env) | sidecar, \
                (node.name, rank)
            assert seen["argv"] == ["train.py", "--flag"]
            assert seen["cwd"] == str(tmp_path / "work")
            seen_ranks.append(int(seen["env"]["RANK"]))
    assert seen_ranks == list(range(plan.world_size))
    # the job's env wins over the planner's value, on every node
    assert all(n.env["OMP_NUM_THREADS"] == "3" for n in plan.nodes)


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_hostile_values_through_real_slurm(tmp_path: Path, slurm_cluster: Any) -> None:
    """sbatch reads #SBATCH lines itself: its quoting, then the shell's, on a real cluster."""
    nodes = list(slurm_cluster.nodes)[:2]
    out = tmp_path / "out"
    out.mkdir()
    tmp_path.chmod(0o755)
    writer = tmp_path / "writer.py"
    writer.write_text(
        "import json, os, sys\n"
        "path = os.path.join(os.environ['OUT'], 'rank' + os.environ['RANK'] + '.json')\n"
        "json.dump({'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': dict(os.environ)},"
        " open(path, 'w'))\n"
    )
    workdir = tmp_path / "work dir 'q' $(touch pwned-w) ; `x`"
    workdir.mkdir()
    inventory = write_yaml(
        tmp_path / "inventory.yaml",
        {
            "name": "testcluster",
            "defaults": {"python": sys.executable},
            "nodes": [{"name": nodes[0], "slots": 2}, {"name": nodes[1], "slots": 1}],
        },
    )
    args = [a for a in HOSTILE if "\n" not in a]
    run_root = tmp_path / "runs 100% 'q' $(touch pwned-r) #x"
    job = write_yaml(
        tmp_path / "job.yaml",
        {
            "name": "hostile",
            "inventory": str(inventory),
            "backend": "slurm",
            "resources": {"nodes": 2, "node_names": nodes},
            "command": ["python", str(writer), *args],
            "workdir": str(workdir),
            "run_root": str(run_root),
            "env": {"OUT": str(out), "HOSTILE": "a 'b' \"c\" $(touch pwned-e) `d` \\ e"},
            "slurm": {"extra_args": ["--comment=two words 'q' \\ #1"]},
        },
    )
    prepared = prepare(job)
    # where the Slurm backend writes it: the run directory (tasks run it again from there)
    sbatch = written(prepared, Path(prepared.plan.run_dir))["job.sbatch"]
    shellcheck(sbatch)
    job_id = slurm_cluster.sbatch(sbatch)
    fields = slurm_cluster.wait(job_id, timeout=120)
    log = next((run_root / prepared.plan.job_id).glob("slurm-*.out"), None)
    assert fields["JobState"] == "COMPLETED", log.read_text() if log else fields
    assert log is not None and log.name == f"slurm-{job_id}.out"  # %j expanded, %% kept as %
    shown = slurm_cluster.run("scontrol", "show", "job", job_id).stdout
    lines = [line.strip() for line in shown.splitlines()]
    assert "Comment=two words 'q' \\ #1" in lines  # the #SBATCH line arrived literally
    ranks = sorted(out.glob("rank*.json"))
    assert len(ranks) == 3
    for path in ranks:
        seen = json.loads(path.read_text())
        assert seen["argv"] == args
        assert seen["cwd"] == str(workdir)
        assert seen["env"]["HOSTILE"] == "a 'b' \"c\" $(touch pwned-e) `d` \\ e"
        assert seen["env"]["WORLD_SIZE"] == "3"
    lws = {json.loads(p.read_text())["env"]["LOCAL_WORLD_SIZE"] for p in ranks}
    assert lws == {"2", "1"}  # uneven: each node's own count
    no_injection(tmp_path)
    assert not list(Path.cwd().glob("pwned*"))
