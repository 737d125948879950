"""The testing knobs (run/knobs.py): a set variable replaces the production wait, a wrong one
is an error naming it, never silently the default."""

from __future__ import annotations

import pytest

from orchestrate.run.knobs import seconds

pytestmark = pytest.mark.unit


def test_unset_or_empty_is_the_production_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCHESTRATE_STORE_PATIENCE_S", raising=False)
    assert seconds("ORCHESTRATE_STORE_PATIENCE_S", 30.0) == 30.0
    monkeypatch.setenv("ORCHESTRATE_STORE_PATIENCE_S", " ")
    assert seconds("ORCHESTRATE_STORE_PATIENCE_S", 30.0) == 30.0


def test_a_set_value_replaces_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHESTRATE_EARLY_EXIT_NOTICE_S", "0.5")
    assert seconds("ORCHESTRATE_EARLY_EXIT_NOTICE_S", 10.0) == 0.5


@pytest.mark.parametrize("text", ["soon", "0", "-1", "nan", "inf"])
def test_a_wrong_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("ORCHESTRATE_LINGER_SLACK_S", text)
    with pytest.raises(ValueError, match=f"ORCHESTRATE_LINGER_SLACK_S='{text}': expected a"):
        seconds("ORCHESTRATE_LINGER_SLACK_S", 30.0)
