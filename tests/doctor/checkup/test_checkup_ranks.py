"""The rank program for real: gloo ranks on loopback, grouped into "nodes" by GROUP_RANK.

What a user checks: every rank exits 0 on a healthy job and rank 0's checkup.json says so; a
rank that never starts, dies or freezes is named with its node, and every rank exits non-zero
within the bounds; the bandwidth tier gives a sane busbw per size and a node-by-node matrix.
"""

from __future__ import annotations

import signal
import socket
import time

import pytest

from orchestrate.doctor.checkup.result import CheckupResult
from tests.support.checkupranks import Starter, free_port

pytestmark = [pytest.mark.process, pytest.mark.torch, pytest.mark.timeout(150), pytest.mark.timing]

SIZES = "64K,1M,4M"


def test_smoke_passes_and_names_nodes(starter: Starter) -> None:
    checkup = starter.start([2, 1], ["--tier", "smoke"])
    assert checkup.wait(90) == {0: 0, 1: 0, 2: 0}, checkup.logs()
    data = checkup.result()
    assert data["ok"] is True and data["failure"] is None
    assert data["tiers"] == ["smoke"] and data["backend"] == "gloo"
    assert data["nodes"] == ["a", "b"]
    assert [(r["rank"], r["node"]) for r in data["ranks"]] == [(0, "a"), (1, "a"), (2, "b")]
    assert set(data["smoke"]["steps_s"]) >= {"join", "init", "monitored_barrier", "barrier",
                                             "all_reduce"}
    assert data["bandwidth"] is None
    assert "checkup: smoke passed on 3 rank(s), 2 node(s) (gloo)" in checkup.rank(0).stdout
    assert checkup.rank(2).stdout.strip() == "checkup: rank 2 (b) ok"


def test_rank_that_never_starts_is_named_within_the_bound(starter: Starter) -> None:
    checkup = starter.start([1, 1, 1], ["--join-timeout-s", "4"], skip=(2,))
    assert checkup.wait(90) == {0: 1, 1: 1}, checkup.logs()
    data = checkup.result()
    failure = data["failure"]
    assert failure["step"] == "join" and failure["ranks"] == [2] and failure["nodes"] == ["c"]
    assert failure["detail"].startswith("rank 2 (node c) never joined")
    # Rank 0 gives up at its join bound (slack: this machine's cores are shared).
    assert data["elapsed_s"] < 4 + 6, data["elapsed_s"]
    assert "rank 2 (node c) never joined" in checkup.rank(1).stderr, "rank 1 learns why"
    spread = abs((checkup.rank(0).ended or 0) - (checkup.rank(1).ended or 0))
    assert spread < 10, spread


def test_missing_rank_on_a_shared_node_is_placed_by_its_node_mates(starter: Starter) -> None:
    checkup = starter.start([2, 2], ["--join-timeout-s", "4"], skip=(3,))
    assert checkup.wait(90) == {0: 1, 1: 1, 2: 1}, checkup.logs()
    failure = checkup.result()["failure"]
    assert failure["ranks"] == [3] and failure["nodes"] == ["b"]


def test_master_port_taken_fails_on_rank_0(starter: Starter) -> None:
    port = free_port()
    with socket.socket() as squatter:
        squatter.bind(("", port))
        squatter.listen(1)
        checkup = starter.start([1, 1], ["--join-timeout-s", "3"], port=port)
        codes = checkup.wait(90)
    assert codes == {0: 1, 1: 1}, checkup.logs()
    failure = checkup.result()["failure"]
    assert failure["step"] == "join" and failure["ranks"] == [0]
    assert f"could not listen on MASTER_PORT {port}" in failure["detail"]
    assert "rank 1 (b) failed in join" in checkup.rank(1).stderr


@pytest.fixture(scope="module")
def two_by_two(module_starter: Starter) -> CheckupResult:
    """Bandwidth on 2 nodes x 2 ranks: the sweep, both intra-node sweeps and the pair."""
    checkup = module_starter.start(
        [2, 2], ["--tier", "bandwidth", "--sizes", SIZES, "--pair-size", "4M",
                 "--budget-s", "0.3"], name="two-by-two")
    assert checkup.wait(120) == {0: 0, 1: 0, 2: 0, 3: 0}, checkup.logs()
    assert "all_reduce busbw" in checkup.rank(0).stdout
    return CheckupResult.from_json(checkup.result())


def test_bandwidth_sweep_has_every_size(two_by_two: CheckupResult) -> None:
    world = two_by_two.world
    assert world is not None and world.ranks == 4 and world.nodes == 2
    assert [s.bytes for s in world.sizes] == [64 << 10, 1 << 20, 4 << 20]
    for size in world.sizes:
        assert size.iters >= 2
        assert 0 < size.time_s <= size.time_max_s
        # Loopback gloo on a few shared cores: between 1 MB/s and 100 GB/s is sane.
        assert 1e-3 < size.busbw_GBps < 100
        assert size.busbw_GBps == pytest.approx(size.algbw_GBps * 2 * 3 / 4)
    assert world.sizes[-1].busbw_GBps > world.sizes[0].busbw_GBps, "latency dominates 64 KiB"


def test_bandwidth_intra_node_sweeps(two_by_two: CheckupResult) -> None:
    assert set(two_by_two.intra) == {"a", "b"}
    for sweep in two_by_two.intra.values():
        assert sweep.ranks == 2 and len(sweep.sizes) == 3
        assert all(s.busbw_GBps > 0 for s in sweep.sizes)


def test_bandwidth_pair_matrix(two_by_two: CheckupResult) -> None:
    pairs = two_by_two.pairs
    assert pairs is not None and pairs.nodes == ("a", "b") and pairs.bytes == 4 << 20
    assert pairs.GBps[0][0] is None and pairs.GBps[1][1] is None
    for value in (pairs.GBps[0][1], pairs.GBps[1][0]):
        assert value is not None and 1e-3 < value < 100


def test_three_nodes_measure_every_pair_both_ways(starter: Starter) -> None:
    checkup = starter.start([1, 1, 1], ["--tier", "bandwidth", "--sizes", "1M",
                                        "--pair-size", "1M", "--budget-s", "0.2"])
    assert checkup.wait(120) == {0: 0, 1: 0, 2: 0}, checkup.logs()
    result = CheckupResult.from_json(checkup.result())
    assert result.pairs is not None and result.pairs.nodes == ("a", "b", "c")
    for i in range(3):
        for j in range(3):
            value = result.pairs.GBps[i][j]
            assert (value is None) == (i == j), (i, j, value)
    assert result.intra == {}, "one rank per node: no intra-node sweep"


def test_rank_killed_mid_sweep_is_named(starter: Starter) -> None:
    checkup = starter.start([2, 2], ["--tier", "bandwidth", "--sizes", "1M,4M,16M",
                                     "--budget-s", "4", "--iters", "100000"])
    checkup.wait_for_step(3, "all_reduce 4 MiB")
    killed = time.monotonic()
    checkup.rank(3).proc.kill()
    codes = checkup.wait(60)
    assert codes == {0: 1, 1: 1, 2: 1, 3: -signal.SIGKILL}, checkup.logs()
    last = max(r.ended or 0 for r in checkup.ranks if r.rank != 3)
    failure = checkup.result()["failure"]
    # Everyone stops within the grace period (and slack for this machine's shared cores).
    assert last - killed < 15, (last - killed, failure, checkup.logs())
    assert failure["tier"] == "bandwidth"
    assert failure["ranks"] == [3] and failure["nodes"] == ["b"], (failure, checkup.logs())
    assert failure["detail"].startswith("rank 3 (node b) stopped answering in all_reduce")
    assert failure["per_rank"]["3"].startswith("silent in all_reduce")


def test_frozen_rank_is_named_after_the_step_bound(starter: Starter) -> None:
    # --budget-s 6: each direction of a pair lasts ~6 s, so the signal lands inside the pair.
    checkup = starter.start([1, 1, 1], ["--tier", "bandwidth", "--sizes", "1M",
                                        "--pair-size", "1M", "--timeout-s", "4",
                                        "--budget-s", "6", "--iters", "100000"])
    # Inside its pair (b <-> c in round 1), not waiting for the round's end: a rank frozen
    # there is found at the partner's operation bound, not at the longer round bound.
    step = checkup.wait_for_step(1, "pairs round 1 (")
    stopped = time.monotonic()
    checkup.rank(1).proc.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while checkup.rank(0).proc.poll() is None or checkup.rank(2).proc.poll() is None:
            assert time.monotonic() < deadline, checkup.logs()
            time.sleep(0.05)
        elapsed = time.monotonic() - stopped
    finally:
        checkup.kill()
    assert checkup.rank(0).proc.returncode == 1 and checkup.rank(2).proc.returncode == 1
    failure = checkup.result()["failure"]
    assert elapsed < 4 + 4 + 8, ("step bound, grace, and some slack on a busy machine",
                                 elapsed, failure, checkup.logs())
    assert failure["ranks"] == [1] and failure["nodes"] == ["b"], failure
    assert "stopped answering in pairs round" in failure["detail"], (step, failure)


def test_bad_environment_is_a_usage_error(starter: Starter) -> None:
    checkup = starter.start([1], ["--tier", "smoke"], env={"RANK": "3"})
    assert checkup.wait(60) == {0: 2}
    assert "RANK: must be below WORLD_SIZE=1" in checkup.rank(0).stderr
    bad = starter.start([1], ["--sizes", "12Q"], name="bad-sizes")
    assert bad.wait(60) == {0: 2}
    assert "--sizes: not a size: '12Q'" in bad.rank(0).stderr
    nccl = starter.start([1], [], env={"ORCHESTRATE_DIST_BACKEND": "nccl"}, name="nccl")
    assert nccl.wait(60) == {0: 2}
    assert "nccl needs CUDA GPUs" in nccl.rank(0).stderr
