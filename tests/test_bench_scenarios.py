"""The learning scenarios under bench/scenarios are well formed: the bench's own loader reads
them, and every correction shows the lesson its scenario checks for (a scenario whose
corrections fail its own check measures the check, not the learner)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from learning import checker, load_scenario  # noqa: E402

SCENARIOS = sorted((BENCH / "scenarios").glob("*.json"))


def test_there_are_scenarios_of_every_kind_the_issue_names():
    assert len(SCENARIOS) >= 10


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_a_scenario_loads_and_its_corrections_pass_its_check(path):
    scenario = load_scenario(path)
    check = checker(scenario)
    assert scenario["name"] == path.stem
    assert len(scenario["train"]) >= 12 and len(scenario["heldout"]) >= 8
    failing = [t["prompt"] for t in scenario["train"] if not check(t["correction"])]
    assert failing == []
    trained = {t["prompt"].casefold() for t in scenario["train"]}
    assert not trained & {p.casefold() for p in scenario["heldout"]}  # held out means never trained on
