"""The learning scenarios under bench/scenarios are well formed: the bench's own loader reads
them, and every correction shows the lesson its scenario checks for (a scenario whose
corrections fail its own check measures the check, not the learner)."""

from __future__ import annotations

import json
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


GOOD = {"check": {"type": "regex", "pattern": "x"}, "train": [{"prompt": "p", "correction": "x"}], "heldout": ["q"]}


@pytest.mark.parametrize(
    ("broken", "said"),
    [
        ([GOOD], "not a JSON object"),
        ({k: v for k, v in GOOD.items() if k != "heldout"}, "no 'heldout'"),
        (GOOD | {"check": {"type": "contains", "pattern": "x"}}, "only regex checks"),
        (GOOD | {"check": {"type": "regex", "pattern": "("}}, "does not compile"),
        (GOOD | {"check": {"type": "regex", "pattern": "x", "flags": "q"}}, "flags 'q'"),
        (GOOD | {"train": []}, "'train' is not a non-empty list"),
        (GOOD | {"train": [{"prompt": "p"}]}, r"train\[0\] has no correction"),
        (GOOD | {"train": [{"correction": "x"}]}, r"train\[0\] has no prompt"),
        (GOOD | {"heldout": ["q", 3]}, "'heldout' is not a non-empty list"),
    ],
)
def test_a_malformed_scenario_is_one_line_before_any_model_loads(tmp_path, broken, said):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken), encoding="utf-8")
    with pytest.raises(SystemExit, match=said) as raised:
        load_scenario(path)
    assert str(raised.value).startswith("error: ") and "\n" not in str(raised.value)


def test_a_scenario_without_a_name_is_named_by_its_file(tmp_path):
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(GOOD), encoding="utf-8")
    assert load_scenario(path)["name"] == "plain"


def test_a_ratings_only_file_may_leave_out_the_corrections(tmp_path):
    path = tmp_path / "ratings.json"
    path.write_text(json.dumps(GOOD | {"train": [{"prompt": "p"}]}), encoding="utf-8")
    assert load_scenario(path, corrections=False)["train"] == [{"prompt": "p"}]
    path.write_text(json.dumps(GOOD | {"train": [{"prompt": "p", "correction": 3}]}), encoding="utf-8")
    with pytest.raises(SystemExit, match=r"train\[0\]'s correction is not text"):
        load_scenario(path, corrections=False)
