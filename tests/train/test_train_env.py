"""Where a rank sits in the job, from its environment: torchrun's contract, Slurm's, or none."""

from __future__ import annotations

import pytest

from orchestrate.core.errors import UserError
from orchestrate.train.env import DistEnv, parse_dist_env, parse_tasks_per_node

pytestmark = pytest.mark.unit

TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node01",
    "MASTER_PORT": "29511",
}


def _error(env: dict[str, str]) -> str:
    with pytest.raises(UserError) as caught:
        parse_dist_env(env)
    text = str(caught.value)
    assert "\n" not in text, "an environment error is one line"
    return text


def test_torchrun_contract() -> None:
    assert parse_dist_env(TORCHRUN) == DistEnv(
        rank=3, local_rank=1, world_size=4, local_world_size=2, group_rank=1,
        master_addr="node01", master_port=29511, source="torchrun",
    )


def test_group_rank_is_optional() -> None:
    env = {k: v for k, v in TORCHRUN.items() if k != "GROUP_RANK"}
    assert parse_dist_env(env).group_rank is None


@pytest.mark.parametrize("var", ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                 "MASTER_ADDR", "MASTER_PORT"])
def test_missing_variable_is_named(var: str) -> None:
    env = {k: v for k, v in TORCHRUN.items() if k != var}
    assert _error(env) == f"environment: {var}: is not set"


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("RANK", "abc", "RANK: must be a whole number (got 'abc')"),
        ("RANK", "-1", "RANK: must be a whole number (got '-1')"),
        ("WORLD_SIZE", "2.5", "WORLD_SIZE: must be a whole number (got '2.5')"),
        ("WORLD_SIZE", "0", "WORLD_SIZE: must be at least 1 (got '0')"),
        ("MASTER_PORT", "70000", "MASTER_PORT: must be a TCP port, 1-65535 (got '70000')"),
        ("RANK", "4", "RANK: must be below WORLD_SIZE=4 (got 4)"),
        ("LOCAL_RANK", "2", "LOCAL_RANK: must be below LOCAL_WORLD_SIZE=2 (got 2)"),
        ("LOCAL_WORLD_SIZE", "5", "LOCAL_WORLD_SIZE: must be between 1 and WORLD_SIZE=4 (got 5)"),
    ],
)
def test_bad_values_are_named(var: str, value: str, message: str) -> None:
    assert _error({**TORCHRUN, var: value}) == f"environment: {message}"


SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "7",
    "SLURM_TASKS_PER_NODE": "2(x3),1",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[07-09],login1",
    "SLURM_JOB_ID": "123456",
}


def test_slurm_only_derives_the_same_facts() -> None:
    place = parse_dist_env(SLURM)
    assert place == DistEnv(
        rank=5, local_rank=1, world_size=7, local_world_size=2, group_rank=2,
        master_addr="gpu07", master_port=20000 + 123456 % 12000, source="slurm",
    )


def test_slurm_uneven_last_node() -> None:
    env = {**SLURM, "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"}
    assert parse_dist_env(env).local_world_size == 1


def test_slurm_ntasks_per_node_wins_and_master_from_env() -> None:
    env = {
        "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n[1-2]",
        "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "31000",
    }
    place = parse_dist_env(env)
    assert (place.local_world_size, place.master_addr, place.master_port) == (2, "10.0.0.5", 31000)
    assert place.group_rank is None


def test_slurm_node_list_fallback_variable() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    env["SLURM_NODELIST"] = "a0[3-4]"
    assert parse_dist_env(env).master_addr == "a03"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_TASKS_PER_NODE": "2(x2)"},
         "SLURM_TASKS_PER_NODE: adds up to 4 tasks, not SLURM_NTASKS=7 (got '2(x2)')"),
        ({"SLURM_TASKS_PER_NODE": "two"}, "SLURM_TASKS_PER_NODE: bad item 'two'"),
        ({"SLURM_NODEID": "9"}, "SLURM_NODEID: must be below the 4 nodes of the job (got 9)"),
        ({"SLURM_PROCID": "7"}, "SLURM_PROCID: must be below SLURM_NTASKS=7 (got 7)"),
        ({"SLURM_LOCALID": "2"},
         "SLURM_LOCALID: must be below SLURM_TASKS_PER_NODE=2 (got 2)"),
        ({"SLURM_JOB_ID": "x"}, "SLURM_JOB_ID: must be a whole number (got 'x')"),
        ({"SLURM_JOB_NODELIST": "gpu[07-"}, "SLURM_JOB_NODELIST: unbalanced '['"),
    ],
)
def test_slurm_problems_are_named(change: dict[str, str], message: str) -> None:
    assert _error({**SLURM, **change}).startswith(f"environment: {message}")


def test_slurm_uneven_nodes_need_the_node_id() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_NODEID"}
    assert "SLURM_NODEID: is not set" in _error(env)


def test_torchrun_variables_win_over_slurm() -> None:
    assert parse_dist_env({**SLURM, **TORCHRUN}).source == "torchrun"


def test_no_launcher_is_a_single_process() -> None:
    place = parse_dist_env({})
    assert (place.rank, place.world_size, place.source) == (0, 1, "standalone")
    assert place.master_port == 0


def test_tasks_per_node() -> None:
    assert parse_tasks_per_node("4") == [4]
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("1,3(x2)") == [1, 3, 3]
