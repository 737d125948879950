"""The GPU health check before a local launch (issue #35): the mixed lab server (2x A100 + 6x
RTX A6000) with GPU 5 waiting for a row remap, replayed by the stand-in nvidia-smi and kernel log
(tests/hostside/gpuhealth/remap-pending). A job is planned around the sick GPU and its plan says
so; a job that needs every A6000 is refused for good (exit 2) naming it; a GPU that goes bad
between attempts is left out of the restart."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fakesmi import HEALTH_CASES, replay_health
from tests.support.localcli import Cli

pytestmark = pytest.mark.process


@pytest.fixture
def sick(cli: Cli) -> Iterator[Cli]:
    bin_dir = replay_health(cli.work / "bin", "remap-pending")
    cli.env["PATH"] = f"{bin_dir}:{cli.env['PATH']}"
    yield cli


def _job(cli: Cli, name: str, gpus: int) -> Path:
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: {gpus}, gpu_model: RTX-A6000}}
        command: [bash, -c, 'echo "gpus=$CUDA_VISIBLE_DEVICES"']
        """)


@pytest.mark.timeout(120)
def test_a_job_is_planned_around_a_sick_gpu_and_one_needing_it_is_refused(sick: Cli) -> None:
    job = sick.id("around")
    done = sick.run("submit", str(_job(sick, "around", 5)), "--job-id", job, "--follow")
    assert done.returncode == 0, done.stderr
    assert "gpus=2,3,4,6,7" in done.stdout
    plan = json.loads((Path(sick.status(job)["run_dir"]) / "plan.json").read_text())
    [note] = [n for n in plan["notes"] if "left out" in n]
    assert "GPU 5 (RTX A6000, 00000000:A1:00.0): 2 uncorrectable ECC errors" in note
    refused = sick.run("submit", str(_job(sick, "all", 6)), "--job-id", sick.id("all"))
    assert refused.returncode == 2, refused.stderr
    said = " ".join(refused.stderr.split())
    assert "5 usable GPU(s) (1 failed the health check), 6 requested" in said
    assert ("GPU 5 (RTX A6000, 00000000:A1:00.0): 2 uncorrectable ECC errors since boot and a "
            "row remap pending: reboot the server (or reset the GPU) to remap; until then "
            "orchestrate will not place ranks on it") in said
    listed = json.loads(sick.run("gpus", "--json", check=True).stdout)
    health = {g["index"]: g["health"] for g in listed["gpus"]}
    assert health == {i: "fail" if i == 5 else "pass" for i in range(8)}
    assert listed["gpus"][5]["health_line"].startswith("GPU 5 (RTX A6000, 00000000:A1:00.0)")
    table = " ".join(sick.run("gpus", check=True).stdout.split())
    assert "fail: GPU 5 (RTX A6000, 00000000:A1:00.0): 2 uncorrectable" in table


@pytest.mark.timeout(120)
def test_a_gpu_that_goes_bad_between_attempts_is_left_out_of_the_restart(cli: Cli) -> None:
    """The first attempt runs on GPUs 2-5; it turns GPU 5 sick (the stand-in now replays
    remap-pending) and fails; the restart checks again and runs on 2, 3, 4 and 6."""
    bin_dir = replay_health(cli.work / "bin", "healthy")
    cli.env["PATH"] = f"{bin_dir}:{cli.env['PATH']}"
    sick = HEALTH_CASES / "remap-pending" / "query.csv"
    marker = cli.work / "went-bad"
    job = cli.write("bad.yaml", f"""
        name: bad
        resources: {{nodes: 1, gpus_per_node: 4, gpu_model: RTX-A6000}}
        restart: {{max: 1, on: [failure], backoff_s: [0]}}
        launcher: per_node
        command: [bash, -c, 'echo "gpus=$CUDA_VISIBLE_DEVICES"; test -e {marker} && exit 0;
                  touch {marker}; cp {sick} {bin_dir}/nvsmi/query.csv; exit 1']
        """)
    done = cli.run("submit", str(job), "--job-id", cli.id("bad"), "--follow")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpus=2,3,4,5" in done.stdout and "gpus=2,3,4,6" in done.stdout
    log = (Path(cli.status(cli.id("bad"))["run_dir"]) / "supervisor.log").read_text()
    assert "restart: GPU(s) 5 failed the health check since the last attempt" in log
    assert "GPU health: GPU 5 (RTX A6000, 00000000:A1:00.0): 2 uncorrectable" in log
