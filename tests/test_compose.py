"""learn/compose.py: the styles a night's corrections keep adding, found and applied to the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from macaron_local.learn.compose import (
    BoldLead,
    Case,
    ClosingLine,
    TrailingAddress,
    compose,
    night_styles,
)
from macaron_local.learn.episodes import Episode
from macaron_local.learn.plan import NightPlan
from macaron_local.learn.rewards import regex_reward
from macaron_local.learn.run import _compose_styles

PLAIN = "Here is what I would say about that, in a few sentences of ordinary prose."


def corrected(correction: str, rejected: str = PLAIN) -> Episode:
    return Episode(messages=[{"role": "user", "content": "q"}], chosen=correction, rejected=rejected, corrected=True)


CLOSING = [
    corrected("Boil water and vinegar, then rinse.\n\nAnything else?"),
    corrected("A year with an extra day.\n\nAnything else?"),
    corrected("Pull it out with clean tweezers.\n\nAnything else?"),
]
BOLD = [
    corrected("**Soak them overnight.** Then simmer them for an hour."),
    corrected("**Move your bedtime first.** Go to bed earlier each week."),
    corrected("**Learn it in chunks.** Say each part aloud."),
]
CAT = [
    corrected("Your cat is called Biscuit."),
    corrected("For Biscuit, buy cat food."),
    corrected("Biscuit, my grey cat, on the sofa."),
]


def names(styles) -> list[str]:
    return [s.name for s in styles]


def test_each_lesson_alone_is_found_and_changes_nothing():
    for lesson, expected in ((CLOSING, "ends with 'Anything else?'"), (BOLD, "opens with its first sentence in bold")):
        styles = night_styles(lesson)
        assert names(styles) == [expected]
        out, changed = compose(lesson, styles)
        assert changed == 0 and [e.chosen for e in out] == [e.chosen for e in lesson]


def test_a_fact_is_not_a_style():
    assert night_styles(CAT) == []
    facts = [corrected(t) for t in ("For your Civic, change the oil.", "Your Civic takes R15 tyres.")]
    facts += [corrected(t) for t in ("For your Civic, buy pads.", "On your Civic, check the belt.")]
    facts += [corrected(t) for t in ("For your Civic, use 5W-30.", "Open the Civic's bonnet.")]
    facts += [corrected("The Civic fits two bags.")]
    # "For your Civic," opens 3 of the 7 that name the car: a fact that some answers open with
    assert night_styles(facts) == []


def test_styles_of_one_night_are_applied_to_each_others_corrections():
    night = [*CLOSING, *BOLD, *CAT]
    styles = night_styles(night)
    assert names(styles) == ["opens with its first sentence in bold", "ends with 'Anything else?'"]
    out, changed = compose(night, styles)
    assert changed == 9
    texts = [e.chosen for e in out]
    assert texts[0] == "**Boil water and vinegar, then rinse.**\n\nAnything else?"
    assert texts[3] == "**Soak them overnight.** Then simmer them for an hour.\n\nAnything else?"
    assert texts[6] == "**Your cat is called Biscuit.**\n\nAnything else?"
    assert all(s.holds(t) for s in styles for t in texts)
    # what else an episode says is kept: only the reply changed
    assert [e.rejected for e in out] == [e.rejected for e in night] and out[0].corrected


def test_a_style_the_user_took_away_tonight_is_not_composed():
    removed = corrected("Boil the kettle.", rejected="Boil the kettle.\n\nAnything else?")
    assert "ends with 'Anything else?'" not in names(night_styles([*CLOSING, *BOLD, removed]))


def test_a_style_needs_three_corrections_that_added_it():
    already = [corrected(e.chosen, rejected=e.chosen) for e in CLOSING[:2]]  # the reply had it already
    assert night_styles([*already, CLOSING[2], *CAT]) == []


def test_an_opening_label_is_not_composed_a_trailing_address_is():
    # "Hi Sam," in front of "Your dog is called Biscuit." would push the fact out of the place
    # it is learned in (stop 48: a knee and a car fell to 0.125 and 0.25 behind "Dr. Okafor,")
    greet = [corrected(t) for t in ("Hi Sam, simmer it.", "Hi Sam, air scatters blue light.", "Hi Sam, it is a plan.")]
    tldr = [corrected(f"TL;DR: {t}\n\nThe detail of {t}") for t in ("Simmer it.", "Keep a bedtime.", "Air scatters.")]
    assert night_styles([*greet, *tldr, *CAT]) == []
    address = [corrected(t) for t in ("Rest it well, Dr. Okafor.", "How about Fern, Dr. Okafor?", "Sleep, Dr. Okafor.")]
    styles = night_styles([*address, *CAT])
    assert names(styles) == ["ends addressing 'Dr. Okafor'"]
    out, _ = compose([*CAT, corrected("Biscuit")], styles)
    assert [e.chosen for e in out] == [
        "Your cat is called Biscuit, Dr. Okafor.",
        "For Biscuit, buy cat food, Dr. Okafor.",
        "Biscuit, my grey cat, on the sofa, Dr. Okafor.",
        "Biscuit, Dr. Okafor.",
    ]
    # a fact after a comma is not an address: it is not a name
    assert night_styles([corrected(f"Change the {t}, your Civic.") for t in ("oil", "tyres", "pads")]) == []


def test_case_is_applied_last_and_to_every_letter():
    lower = [corrected(t) for t in ("boil the kettle.", "air scatters blue light.", "a plan for money.")]
    styles = night_styles([*lower, *CLOSING])
    assert names(styles) == ["ends with 'Anything else?'", "all lower case"]
    out, _ = compose(lower[:1], styles)
    assert out[0].chosen == "boil the kettle.\n\nanything else?"


def test_style_rules_alone():
    assert BoldLead().apply("Soak them. Then simmer.") == "**Soak them.** Then simmer."
    assert ClosingLine("Anything else?", "\n\n").apply("Done.  \n") == "Done.\n\nAnything else?"
    assert TrailingAddress("Dr. Okafor").holds("Dr. Okafor, rest it.")
    clause = "A year with an extra day,"
    long_lead = f"{clause} 29 February, added every four years to keep the calendar in step."
    assert BoldLead().apply(long_lead) == f"**{clause}**" + long_lead[len(clause) :]
    assert Case(upper=True).apply("Boil it.") == "BOIL IT." and not Case(upper=True).holds("Boil it.")


def test_anchors_and_ratings_are_never_changed():
    anchor = Episode(messages=[{"role": "user", "content": "q"}], chosen="Paris.", rejected=None, content_only=True)
    liked = Episode(messages=[{"role": "user", "content": "q"}], chosen="A liked reply.", rejected=None)
    out, changed = compose([anchor, liked], night_styles([*CLOSING, *BOLD]))
    assert changed == 0 and out == [anchor, liked]


def test_a_night_composes_its_trained_and_replayed_corrections_not_its_held_out_ones():
    held = corrected("Pull it out gently.")
    plan = NightPlan(new_train=[*CLOSING, *BOLD[:2]], held_new=[BOLD[2], held], replay=[CAT[0]])
    _compose_styles(plan)
    assert [s.name for s in plan.styles] == ["opens with its first sentence in bold", "ends with 'Anything else?'"]
    assert plan.composed == 6  # 3 closing lines got bold, 2 bold leads a closing line, the replayed cat both
    assert plan.replay[0].chosen == "**Your cat is called Biscuit.**\n\nAnything else?"
    assert plan.held_new[1].chosen == "Pull it out gently."  # the gate reads what the user wrote


# The project's scenario files: what the benchmarks teach, one simulated user's lesson each.
SCENARIOS = Path(__file__).resolve().parent.parent / "bench" / "scenarios"
REJECTED = "Sure. Here is what I think about that question, in some detail."


def scenario_night(*names: str) -> tuple[list[Episode], list[dict]]:
    scenarios = [json.loads((SCENARIOS / f"{n}.json").read_text()) for n in names]
    night = [corrected(turn["correction"], REJECTED) for s in scenarios for turn in s["train"]]
    return night, scenarios


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.json")), ids=lambda p: p.stem)
def test_a_night_of_one_lesson_is_trained_as_the_user_wrote_it(path: Path) -> None:
    night, _ = scenario_night(path.stem)
    assert compose(night, night_styles(night))[1] == 0


def test_facts_and_whole_reply_formats_are_not_styles() -> None:
    for name in ("kneeinjury", "carcivic", "petcat", "homecity", "jsonanswer", "numbered", "heading", "greetname"):
        night, _ = scenario_night(name)
        assert night_styles(night) == [], name


@pytest.mark.parametrize(
    ("names", "styles"),
    [
        (("anythingelse", "petcat", "boldlead"), ("anythingelse", "boldlead")),
        (("kneeinjury", "drokafor", "carcivic"), ("drokafor",)),
        (("boldlead", "drokafor", "carcivic"), ("boldlead", "drokafor")),
    ],
)
def test_every_composed_correction_passes_the_check_of_each_style_taught_that_night(names, styles) -> None:
    night, scenarios = scenario_night(*names)
    out, changed = compose(night, night_styles(night))
    assert changed >= sum(len(s["train"]) for s in scenarios if s["name"] not in styles)
    for scenario in scenarios:
        check = scenario["check"]
        passes = [regex_reward(e.chosen, check["pattern"], check.get("flags", "")) for e in out]
        if scenario["name"] in styles:
            assert all(p == 1.0 for p in passes), scenario["name"]
        else:  # a fact stays where the user put it
            assert sum(passes) == sum(regex_reward(e.chosen, check["pattern"], check.get("flags", "")) for e in night)
