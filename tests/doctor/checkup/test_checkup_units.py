"""The checkup's pure parts: pair rounds, iteration counts, blame, sizes, the result's JSON."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrate.core.errors import UserError
from orchestrate.doctor.checkup.blame import Member, Report, blame, locate, never_joined, ranks_text
from orchestrate.doctor.checkup.measure import expected_sums
from orchestrate.doctor.checkup.options import human, parse_options, parse_size
from orchestrate.doctor.checkup.result import (
    CheckupFailure,
    CheckupResult,
    PairMatrix,
    Sweep,
    combine,
)
from orchestrate.doctor.checkup.schedule import pair_rounds, plan_iters

pytestmark = pytest.mark.unit


@given(st.integers(min_value=0, max_value=40))
def test_pair_rounds_cover_every_pair_once_with_disjoint_rounds(count: int) -> None:
    rounds = pair_rounds(count)
    seen = [p for r in rounds for p in r]
    assert sorted(seen) == [(i, j) for i in range(count) for j in range(i + 1, count)]
    for pairs in rounds:
        nodes = [n for p in pairs for n in p]
        assert len(nodes) == len(set(nodes)), "a node in two pairs at once"
    if count >= 2:
        assert len(rounds) == (count - 1 if count % 2 == 0 else count)


def test_plan_iters() -> None:
    # No budget: exactly what was asked (a benchmark).
    assert plan_iters(0.5, warmup=5, iters=10, min_iters=2, budget_s=0) == (4, 10)
    # Fast operations: the maximum.
    assert plan_iters(0.001, 5, 10, 2, 2.0) == (4, 10)
    # 256 MiB at 0.5 s: four fit in 2 s, one more warm-up in a quarter of it.
    assert plan_iters(0.5, 5, 10, 2, 2.0) == (1, 4)
    # Slower than the budget: the minimum, no further warm-up.
    assert plan_iters(3.0, 5, 10, 2, 2.0) == (0, 2)


def test_smoke_expectation_is_exact() -> None:
    sums = expected_sums(3)
    # element 0: ranks 0,1,2 contribute 1,2,3; element 7: 8,1,2
    assert sums[0] == 6 and sums[7] == 11
    assert max(expected_sums(2_000_000)) < 2**24 * 2, "fits float32's exact integers"


def test_sizes() -> None:
    assert parse_size("256M") == 256 << 20
    assert parse_size("32KiB") == 32 << 10
    assert parse_size("1g") == 1 << 30
    with pytest.raises(ValueError):
        parse_size("12Q")
    assert human(256 << 20) == "256 MiB" and human(1 << 30) == "1 GiB" and human(6) == "6 B"


def test_options() -> None:
    opts = parse_options(["--tier", "bandwidth", "--sizes", "1M,32K,1M"],
                         {"ORCHESTRATE_NODE_NAMES": "gpu01,gpu02"})
    assert opts.tiers == ("smoke", "bandwidth")
    assert opts.sizes == (32 << 10, 1 << 20)
    assert opts.names == ("gpu01", "gpu02")
    assert parse_options(["--tier", "all"], {}).tiers == (
        "static", "health", "connect", "smoke", "bandwidth")
    assert parse_options(["--node-names", "a,b"], {"ORCHESTRATE_NODE_NAMES": "x"}).names == (
        "a", "b")
    with pytest.raises(UserError) as err:
        parse_options(["--tier", "nodes", "--timeout-s", "0", "--nodes", "0"], {})
    assert [p.field for p in err.value.problems] == ["--tier", "--timeout-s", "--nodes"]


def test_ranks_text() -> None:
    assert ranks_text([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert ranks_text([3]) == "3"


def test_locate_missing_ranks() -> None:
    members = [Member(0, "a", 0, 4), Member(1, "a", 0, 4), Member(4, "b", 4, 4)]
    # Rank 2 is on a (its node mates joined); 8-11 on c by the uniform layout.
    where = locate([2, 9], members, ["a", "b", "c"])
    assert where == {2: "a", 9: "c"}
    uneven = [Member(0, "a", 0, 3), Member(3, "b", 3, 2)]
    assert locate([5], uneven, ["a", "b", "c"]) == {5: "c"}
    assert locate([5], uneven, ["a", "b", "c", "d"]) == {5: "one of c, d"}
    assert locate([5], uneven, []) == {5: "unknown node"}


def test_blame_silent_rank_first() -> None:
    node_of = {0: "a", 1: "a", 2: "b", 3: "b"}
    reports = {r: Report("all_reduce 1 MiB", "collective", "Connection reset by peer")
               for r in (0, 1, 2)}
    failure = blame("bandwidth", "all_reduce 1 MiB", reports, [3], {3: "all_reduce 1 MiB"},
                    node_of)
    assert failure.ranks == (3,) and failure.nodes == ("b",)
    assert failure.detail.startswith("rank 3 (node b) stopped answering in all_reduce 1 MiB")
    assert failure.per_rank[3] == "silent in all_reduce 1 MiB"


def test_blame_own_failure_before_symptoms() -> None:
    node_of = {0: "a", 1: "b"}
    reports = {
        0: Report("all_reduce", "collective", "Connection closed by peer"),
        1: Report("all_reduce", "wrong", "all_reduce result is wrong: element 3 is 5"),
    }
    failure = blame("smoke", "all_reduce", reports, [], {}, node_of)
    assert failure.ranks == (1,) and failure.nodes == ("b",)
    assert failure.detail == ("rank 1 (node b) failed in all_reduce: all_reduce result is "
                              "wrong: element 3 is 5")


def test_blame_everyone_with_the_common_cause() -> None:
    node_of = {0: "a", 1: "a", 2: "b"}
    reports = {r: Report("init", "collective", "Connection refused") for r in (0, 1, 2)}
    failure = blame("smoke", "init", reports, [], {}, node_of)
    assert failure.ranks == (0, 1, 2)
    assert failure.detail == "ranks 0-2 (nodes a, b) failed in init: Connection refused"


def test_never_joined_text() -> None:
    failure = never_joined([6, 7], {6: "c", 7: "c"}, 8, 60, "10.0.0.1:29500")
    assert failure.detail.startswith("ranks 6-7 (node c) never joined: 2 of 8 rank(s) did "
                                     "not reach the master 10.0.0.1:29500 within 60 s")


def test_result_json_round_trip() -> None:
    world = Sweep(4, 2, (combine(1 << 20, 10, [0.002, 0.004, 0.003, 0.003], 4),))
    result = CheckupResult(
        tiers=("smoke", "bandwidth"), backend="gloo", world_size=4, nodes=("a", "b"),
        ranks=({"rank": 0, "node": "a"},), elapsed_s=3.25, steps_s={"join": 0.5},
        world=world, intra={"a": Sweep(2, 1, (combine(1 << 20, 10, [0.002, 0.003], 2),))},
        pairs=PairMatrix(("a", "b"), 1 << 24, ((None, 1.5), (1.25, None))),
        failure=CheckupFailure("bandwidth", "pairs round 1", "text", (2,), ("b",), {2: "silent"}),
    )
    data = result.to_json()
    assert data["bandwidth"]["all_reduce"]["sizes"][0]["time_s"] == pytest.approx(0.003)
    assert data["bandwidth"]["all_reduce"]["sizes"][0]["time_max_s"] == 0.004
    back = CheckupResult.from_json(data)
    assert back.to_json() == data
    assert back.pairs is not None and back.pairs.rate(0, 1) == 1.25
    assert not back.ok
