"""The job's ``launcher:``: what each node starts, with what environment, and what is refused.

The planner called directly (the plans and messages a user sees through ``plan``, ``validate``
and ``submit``): a ``per_node`` node starts one process with NODE_RANK, NNODES, NPROC_PER_NODE
and no RANK; a ``torchrun`` node starts its own ``torch.distributed.run`` with the plan's static
rendezvous; commands that would build worlds of their own are refused with the fix.
"""

from __future__ import annotations

import pytest

from orchestrate.core.plan.launch import environment_bin, launcher_in, not_found
from orchestrate.core.plan.plan import Occupancy, Plan
from tests.support.plans import gpu_node, inventory, job, plan, refusal

pytestmark = pytest.mark.unit

UNEVEN = inventory(gpu_node("a", 3, address="10.0.0.1"), gpu_node("b", 2, address="10.0.0.2"),
                   python="/opt/envs/train/bin/python3")


def test_per_node_gives_each_node_one_process_and_its_place_in_the_world() -> None:
    p = plan(job(launcher="per_node", resources={"nodes": 2, "gpus_per_node": "all"}), UNEVEN)
    assert p.per_node and [p.processes(n) for n in p.nodes] == [1, 1]
    a, b = p.nodes
    assert {k: a.env[k] for k in ("NODE_RANK", "NNODES", "NPROC_PER_NODE",
                                  "ORCHESTRATE_FIRST_RANK")} == {
        "NODE_RANK": "0", "NNODES": "2", "NPROC_PER_NODE": "3", "ORCHESTRATE_FIRST_RANK": "0"}
    assert {k: b.env[k] for k in ("NODE_RANK", "NPROC_PER_NODE", "ORCHESTRATE_FIRST_RANK")} == {
        "NODE_RANK": "1", "NPROC_PER_NODE": "2", "ORCHESTRATE_FIRST_RANK": "3"}
    # Every one of the node's planned GPUs visible, as for ranks; the world is still the plan's.
    assert (a.cuda_visible_devices, b.cuda_visible_devices) == ("0,1,2", "0,1")
    assert p.env["WORLD_SIZE"] == "5" and p.env["MASTER_ADDR"] == "10.0.0.1"
    assert p.env["ORCHESTRATE_LAUNCHER"] == "per_node"
    # No rank of its own: the workers it starts would inherit one.
    assert not {"RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"} & {*p.env, *a.env, *b.env}
    assert a.command == ("/opt/envs/train/bin/python3", "train.py")
    assert [r.rank for r in p.ranks] == [0, 1, 2, 3, 4]  # the ranks its workers join as


def test_torchrun_runs_the_nodes_torch_distributed_run_with_the_plans_rendezvous() -> None:
    p = plan(job(launcher="torchrun", resources={"nodes": 2, "gpus_per_node": "all"},
                 command=["python", "-u", "train.py", "--lr", "0.1"]), UNEVEN, job_id="tr-1")
    a, b = p.nodes
    head = ("/opt/envs/train/bin/python3", "-m", "torch.distributed.run", "--nnodes=2")
    master = ("--master-addr=10.0.0.1", f"--master-port={p.master_port}",
              "--rdzv-backend=static", "--rdzv-id=tr-1", "--max-restarts=0")
    assert a.command == (*head, "--node-rank=0", "--nproc-per-node=3", *master,
                         "train.py", "--lr", "0.1")
    assert b.command == (*head, "--node-rank=1", "--nproc-per-node=2", *master,
                         "train.py", "--lr", "0.1")
    assert "RANK" not in a.env and p.env["ORCHESTRATE_LAUNCHER"] == "torchrun"
    assert p.env["TORCHELASTIC_RUN_ID"] == "tr-1"  # what torchrun gives the workers too


def test_torchrun_catches_the_stop_signals_slurm_sends_to_every_process_of_a_step() -> None:
    """torch's agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT only: SIGUSR2 before a Slurm
    time limit would end the agent (and Slurm the workers with it) mid-checkpoint. The node's
    script exports torchrun's ``--signals-to-handle`` as its environment gives it, which a torch
    without the option (before 2.9) ignores; the job's own Slurm signal is added."""
    from orchestrate.core.render.render import node_scripts

    p = plan(job(launcher="torchrun", backend="ssh"), UNEVEN)
    script = next(iter(node_scripts(p, None).values()))
    assert "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2\n" in script
    urg = plan(job(launcher="torchrun", backend="slurm", slurm={"signal": "URG"}), UNEVEN)
    assert urg.nodes[0].env["PET_SIGNALS_TO_HANDLE"] == (
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2,SIGURG")
    # Other launchers: the ranks are orchestrate's own processes and get the signals directly.
    assert "PET_SIGNALS_TO_HANDLE" not in plan(job(), UNEVEN).nodes[0].env


def test_torchrun_waits_for_its_signalled_workers_as_long_as_the_job_gives_them() -> None:
    """Once signalled, torch's agent kills its workers after 30 s: a checkpoint on the stop
    signal that takes longer was cut short. The agent now waits the job's own lead before the
    time limit (``slurm.signal_seconds_before``), through torchrun's environment."""
    from orchestrate.core.render.render import node_scripts

    p = plan(job(launcher="torchrun", backend="ssh"), UNEVEN)
    script = next(iter(node_scripts(p, None).values()))
    assert "export PET_SHUTDOWN_TIMEOUT=120\n" in script
    late = plan(job(launcher="torchrun", backend="slurm", slurm={"signal_seconds_before": 600}),
                UNEVEN)
    assert {n.env["PET_SHUTDOWN_TIMEOUT"] for n in late.nodes} == {"600"}
    assert "PET_SHUTDOWN_TIMEOUT" not in plan(job(launcher="per_node"), UNEVEN).nodes[0].env


def test_torchrun_takes_a_module_or_a_program_that_is_not_python() -> None:
    inv = inventory(gpu_node("a", 2))
    module = plan(job(launcher="torchrun", command=["python3", "-m", "pkg.train", "--x"]), inv)
    assert module.nodes[0].command[-4:] == ("--max-restarts=0", "-m", "pkg.train", "--x")
    other = plan(job(launcher="torchrun", command=["bash", "run.sh"]), inv)
    assert other.nodes[0].command[-4:] == ("--max-restarts=0", "--no-python", "bash", "run.sh")


def test_a_port_found_free_reaches_the_torchrun_line() -> None:
    """SSH re-plans with the port the master host found free: the node's command says it."""
    p = plan(job(launcher="torchrun"), inventory(gpu_node("a", 2)),
             occupancy=Occupancy(master_port=24680))
    assert "--master-port=24680" in p.nodes[0].command and p.master_port == 24680


def test_launcher_survives_the_stored_plan() -> None:
    p = plan(job(launcher="per_node", distributed={"on_wrong_world": "report"}),
             inventory(gpu_node("a", 2)))
    again = Plan.from_json(p.to_json())
    assert (again.launcher, again.on_wrong_world, again.per_node) == ("per_node", "report", True)
    assert again == p
    old = {k: v for k, v in p.to_json().items() if k not in ("launcher", "on_wrong_world")}
    assert Plan.from_json(old).launcher == "ranks"  # a plan stored before launchers existed


def test_commands_are_looked_up_in_the_nodes_python_environment() -> None:
    assert environment_bin("/opt/envs/train/bin/python3") == "/opt/envs/train/bin"
    assert environment_bin("python3") is None
    assert not_found("torchrun", "/opt/envs/train/bin/python3") == (
        "torchrun: not in /opt/envs/train/bin or on PATH")
    assert not_found("torchrun", "python3") == "torchrun: not on PATH"


@pytest.mark.parametrize(("command", "named"), [
    (["torchrun", "--nproc-per-node=2", "train.py"], "torchrun"),
    (["/opt/env/bin/torchrun", "train.py"], "torchrun"),
    (["python", "-m", "torch.distributed.run", "train.py"], "python -m torch.distributed.run"),
    (["python3.11", "-u", "-m", "torch.distributed.launch", "t.py"],
     "python -m torch.distributed.launch"),
    (["accelerate", "launch", "train.py"], "accelerate launch"),
    (["python", "-m", "accelerate.commands.launch", "t.py"], "accelerate launch"),
    (["deepspeed", "train.py"], "deepspeed"),
    (["python", "train.py", "-m", "torch.distributed.run"], None),
    (["accelerate", "config"], None),
    (["python", "-c", "import torch"], None),
])
def test_launchers_are_recognised_by_how_people_write_them(command: list[str],
                                                           named: str | None) -> None:
    assert launcher_in(tuple(command)) == named


def test_a_launcher_under_ranks_is_refused_with_the_fix() -> None:
    inv = inventory(gpu_node("a", 2), gpu_node("b", 2))
    text = refusal(job(resources={"nodes": 2},
                       command=["torchrun", "--nproc-per-node=2", "train.py"]), inv)
    assert "command: starts torchrun, which starts workers of its own" in text
    assert "every rank would build a separate world" in text
    assert "hint: write launcher: torchrun" in text
    text = refusal(job(launcher="torchrun", command=["accelerate", "launch", "t.py"]), inv)
    assert "drop `accelerate launch` and its options" in text


def test_the_built_in_trainer_keeps_one_process_per_rank() -> None:
    spec = job(launcher="torchrun", command=None,
               train={"model": "m:net", "dataset": "d:load", "model_params": 1e6})
    text = refusal(spec, inventory(gpu_node("a", 2)))
    assert "launcher: the built-in trainer (train:) runs one process per rank" in text


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "MASTER_ADDR",
                                  "MASTER_PORT", "RANK", "LOCAL_RANK"])
def test_env_cannot_override_what_the_plan_sets(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} (would silently override the plan|is set per)"):
        job(env={name: "1"})
