"""Hard routing per turn: explicit > pending > the route hop; keyword rules only as the fallback mode.

(The route hop's order and defaults are in test_protocol_units.py, on the model in test_protocol.py.)"""

from __future__ import annotations

import pytest

from macaron_local.errors import InvalidInputError
from macaron_local.router import keyword_scores, normalize_slot, route


@pytest.mark.parametrize(
    ("text", "slot"),
    [
        ("Why does my Python function raise a KeyError?", "L2"),
        ("Fix this bug in my SQL query", "L2"),
        ("Make the navbar responsive and fix the button colour in CSS", "L3"),
        ("Remind me to call mum and add it to my calendar", "L1"),
        ("What is a good name for a cat?", "L0"),
        ("Tell me about the history of Rome", "L0"),
    ],
)
def test_keyword_fallback_mode(text, slot):
    decision = route(text, mode="keywords")
    assert decision.slot == slot
    assert decision.method == ("keywords" if slot != "L0" else "default")
    assert decision.reason


def test_whole_words_only():
    assert keyword_scores("please decode this")["L2"] == 0
    assert keyword_scores("please look at this code")["L2"] == 1


def test_explicit_and_pending_win_over_keywords():
    assert route("fix the python bug", explicit="ui", mode="keywords").slot == "L3"
    assert route("fix the python bug", explicit="L1", mode="keywords").method == "explicit"
    decision = route("here is the tool output: 42", pending_slot="L1", mode="keywords")
    assert (decision.slot, decision.method) == ("L1", "pending")


def test_tie_falls_back_to_default():
    decision = route("design a python api", mode="keywords")  # L2: python, api; L3: design -> L2 wins
    assert decision.slot == "L2"
    tie = route("css code", mode="keywords")  # one keyword each for L2 and L3
    assert (tie.slot, tie.method) == ("L0", "default") and "tied" in tie.reason


def test_normalize_slot():
    assert normalize_slot("l2") == normalize_slot("2") == normalize_slot("Coding") == "L2"
    with pytest.raises(InvalidInputError):
        normalize_slot("L7")
