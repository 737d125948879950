"""Slurm-style hostlists: expansion as Slurm does it, and compression that expands back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrate.core.spec import hostlist

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[1-2,7],login1", ["n1", "n2", "n7", "login1"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
        ("a, b", ["a", "b"]),
    ],
)
def test_expand(text: str, names: list[str]) -> None:
    assert hostlist.expand(text) == names


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("gpu[01-16", "unbalanced '['"),
        ("gpu01-16]", "unbalanced ']'"),
        ("gpu[[1-2]]", "nested '['"),
        ("gpu[16-01]", "runs backwards"),
        ("gpu[a-b]", "bad range"),
        ("a,,b", "empty name"),
        ("n[1-1000000000]", "more than"),
        ("a[1-1000]b[1-1000]", "more than"),
    ],
)
def test_malformed_hostlists_are_refused(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[")):
        hostlist.expand(text)


def test_compress() -> None:
    names = [f"gpu{i:02d}" for i in range(1, 17)]
    assert hostlist.compress(names) == "gpu[01-16]"
    assert hostlist.compress(["n9", "n10", "n11", "x", "n3"]) == "n[9-11],x,n3"
    assert hostlist.compress(["gpu03", "gpu04", "gpu05", "gpu09"]) == "gpu[03-05,09]"


names_strategy = st.lists(
    st.builds(
        lambda prefix, number, width: f"{prefix}{number:0{width}d}" if number >= 0 else prefix,
        st.sampled_from(["gpu", "n", "node-", "a1b", "x"]),
        st.integers(-1, 120),
        st.integers(0, 3),
    ),
    unique=True,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(names_strategy)
def test_compress_expands_back_to_the_same_names(names: list[str]) -> None:
    if not names:
        return
    assert hostlist.expand(hostlist.compress(names)) == names
