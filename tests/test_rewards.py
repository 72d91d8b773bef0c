"""Reward functions on hand-checked strings: token F1, chrF, the preference reward, regex checks,\nlesson words."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from macaron_local.learn.rewards import (
    LENGTH_WEIGHT,
    OPENING_MARK,
    chrf,
    content_kept,
    content_words,
    first_sentence,
    length_given_back,
    lesson_opening,
    lesson_recall,
    lesson_words,
    preference_reward,
    regex_reward,
    token_f1,
)


# ----------------------------------------------------------------- token_f1
def test_token_f1_counts_repeats_ignores_case_and_punctuation() -> None:
    # bags {the, cat, sat} and {the x2, cat}: overlap 2, P = R = 2/3
    assert token_f1("The cat sat", "the cat the") == pytest.approx(2 / 3)
    assert token_f1("Hello, world!", "hello world") == 1.0
    assert token_f1("a b", "c d") == 0.0
    # overlap 1, P = 1/1, R = 1/4: F1 = 2 * 1 * 0.25 / 1.25
    assert token_f1("yes", "yes it is so") == pytest.approx(0.4)


def test_token_f1_of_empty_texts() -> None:
    assert token_f1("", "") == 1.0
    assert token_f1("", "something") == 0.0 and token_f1("!!", "something") == 0.0


# ----------------------------------------------------------------- chrf
def test_chrf_exact_value_by_hand() -> None:
    # "ab" vs "abc": n=1 P 2/2 R 2/3; n=2 P 1/1 R 1/2; n=3 P 0 (no trigram) R 0/1; n>=4 neither has any.
    # chrP = 2/3, chrR = 7/18, chrF2 = 5 chrP chrR / (4 chrP + chrR) = 14/33
    assert chrf("ab", "abc") == pytest.approx(14 / 33)


def test_chrf_identical_disjoint_whitespace_and_empty() -> None:
    assert chrf("Use xs[::-1] to reverse.", "Use xs[::-1] to reverse.") == pytest.approx(1.0)
    assert chrf("abc", "xyz") == 0.0
    assert chrf("a b\n c", "abc") == pytest.approx(1.0)  # whitespace is removed, as in sacreBLEU's chrF
    assert chrf("", "") == 1.0 and chrf("", "abc") == 0.0 and chrf(" ", "abc") == 0.0


def test_chrf_weighs_recall_over_precision() -> None:
    reference = "the meeting is on tuesday"
    says_all_and_more = "the meeting is on tuesday at noon in room four"
    says_half = "the meeting"
    assert chrf(says_all_and_more, reference) > chrf(says_half, reference)
    assert 0.0 < chrf(says_half, reference) < 1.0


def test_chrf_gives_partial_credit_for_a_typo() -> None:
    assert chrf("recieve the parcel", "receive the parcel") > 0.7
    assert token_f1("recieve the parcel", "receive the parcel") == pytest.approx(2 / 3)


# ----------------------------------------------------------------- preference_reward
def test_preference_reward_extremes() -> None:
    assert preference_reward("abc", chosen="abc", rejected="xyz") == pytest.approx(1.0)
    assert preference_reward("xyz", chosen="abc", rejected="xyz") == pytest.approx(-1.0)
    assert preference_reward("abc", chosen="abc", rejected="abc") == 0.0


def test_preference_reward_moves_toward_the_correction() -> None:
    chosen, rejected = "Your name is Ada.", "I don't know your name."
    near_chosen = "Your name is Ada!"
    near_rejected = "I do not know your name."
    assert preference_reward(near_chosen, chosen, rejected) > 0 > preference_reward(near_rejected, chosen, rejected)


# The user cut a 20-word reply to 5 words.
_LONG = "Tea is made by boiling water then pouring it over leaves and waiting for about five minutes before you drink"
_CUT = "Pour boiling water over leaves."


def test_length_given_back_is_the_share_the_user_would_cut_again_over_the_share_they_cut() -> None:
    assert length_given_back("Steep leaves in hot water.", _CUT, _LONG) == 0.0  # as short as the correction
    assert length_given_back("Hot water.", _CUT, _LONG) == 0.0  # shorter is never charged
    eleven = "Pour boiling water over leaves and wait five minutes to drink."
    assert length_given_back(eleven, _CUT, _LONG) == pytest.approx((1 - 5 / 11) / (1 - 5 / 20))
    assert length_given_back(_LONG, _CUT, _LONG) == pytest.approx(1.0)  # all of the cut given back
    assert length_given_back(_LONG + " " + _LONG, _CUT, _LONG) == 1.0  # never more than all of it


def test_length_given_back_charges_the_first_words_past_the_cut_the_most() -> None:
    words = [length_given_back(" ".join(["word"] * n), _CUT, _LONG) for n in range(5, 21)]
    steps = [b - a for a, b in itertools.pairwise(words)]
    assert all(step > 0 for step in steps)  # every word more costs more
    assert steps == sorted(steps, reverse=True)  # and each costs less than the one before
    assert words[10 - 5] > (10 - 5) / (20 - 5)  # twice the correction's length costs more than linearly


def test_length_given_back_is_zero_without_a_cut() -> None:
    longer = _LONG + " slowly"
    assert length_given_back(longer, _LONG, _CUT) == 0.0  # the correction added words
    assert length_given_back(longer, " ".join(_LONG.split()[:16]), _LONG) == 0.0  # 16 of 20 words: an edit, not a cut
    assert length_given_back(longer, _CUT, None) == 0.0  # a rating says nothing of length
    assert length_given_back(longer, None, _LONG) == 0.0


def test_preference_reward_prefers_the_sample_that_keeps_the_cut() -> None:
    said_and_more = _CUT + " Then wait five minutes, add milk if you like, and drink it warm."
    assert chrf(said_and_more, _CUT) > 0.6  # chrF alone hardly sees the extra words (recall first)
    assert preference_reward(_CUT, _CUT, _LONG) - preference_reward(said_and_more, _CUT, _LONG) > 0.2


def test_preference_reward_with_one_side_uses_only_that_side() -> None:
    assert preference_reward("Paris.", "Paris.", None) == pytest.approx(1.0)
    assert preference_reward("Paris.", None, "Paris.") == pytest.approx(-1.0)
    assert preference_reward("Lyon", "Paris.", None) == pytest.approx(chrf("Lyon", "Paris."))
    assert preference_reward("Lyon", None, "Paris.") == pytest.approx(-chrf("Lyon", "Paris."))
    with pytest.raises(ValueError):
        preference_reward("x", None, None)


def test_preference_reward_with_several_disliked_replies_charges_the_nearest() -> None:
    """A sample that left the first disliked answer by becoming another one is no better."""
    first, second = "Blue is my favourite colour.", "Red is a warm colour."
    assert preference_reward(second, None, first, (second,)) == pytest.approx(-1.0)
    assert preference_reward(second, None, first) > -1.0  # judged on the first alone, it looked better
    fresh = "Teal, a green-blue."
    assert preference_reward(fresh, None, first, (second,)) == pytest.approx(
        -max(chrf(fresh, first), chrf(fresh, second))
    )


def test_preference_reward_stays_in_range_on_random_text() -> None:
    rng = random.Random(0)

    def text() -> str:
        return "".join(rng.choice("ab c") for _ in range(rng.randint(0, 12)))

    for _ in range(300):
        chosen, rejected = rng.choice([text(), None]), text()
        assert -1.0 - LENGTH_WEIGHT <= preference_reward(text(), chosen, rejected) <= 1.0


# ----------------------------------------------------------------- regex_reward
def test_regex_reward_searches_anywhere_with_flags() -> None:
    assert regex_reward("Bonjour, ça va ?", r"\bbonjour\b", flags="i") == 1.0
    assert regex_reward("Bonjour, ça va ?", r"\bbonjour\b") == 0.0
    assert regex_reward("line one\nend", r"^end$", flags="m") == 1.0
    assert regex_reward("no emoji here", r"[\U0001F600-\U0001F64F]") == 0.0
    with pytest.raises(ValueError, match="unknown regex flag"):
        regex_reward("x", "x", flags="q")


ANSWER = "The capital of Italy is Rome. It is famous for the Colosseum and its food."


def test_first_sentence_and_content_words() -> None:
    assert first_sentence(ANSWER) == "The capital of Italy is Rome."
    assert first_sentence("No end") == "No end" and first_sentence("3.5 kg. Then more.") == "3.5 kg."
    assert content_words("The capitals of Italy, is it Rome?") == {"capit", "italy", "rome"}


def test_content_kept_ignores_form_and_scores_lost_content() -> None:
    for same_content in (
        "Hi Sam, the capital of Italy is Rome.",  # a greeting added
        "the capital of italy is rome",  # lower case
        "- Rome is the capital of Italy",  # a list item, words reordered
        "TL;DR: Italy's capital is Rome.",  # a prefix
        ANSWER,
    ):
        assert content_kept(same_content, ANSWER) == 1.0, same_content
    wrong = content_kept("Lisbon is the capital of Portugal.", ANSWER)
    poured = content_kept("Biscuit, France has a capital city called Lille.", ANSWER)
    assert wrong == poured == pytest.approx((1 / 3) / 0.75)
    assert content_kept("", ANSWER) == 0.0 and content_kept("anything", "It is.") == 1.0  # nothing to keep
    assert content_kept("Italy is lovely.", ANSWER, enough=1.0) == pytest.approx(1 / 3)


def test_content_kept_counts_only_what_the_answer_adds_to_the_question() -> None:
    """Restating the question is free; only the answer's own words are content to keep."""
    question, answer = "What is the capital of France?", "The capital of France is Paris."
    assert content_kept("Lyon is the capital of France.", answer, question) == 0.0
    assert content_kept("Lyon is the capital of France.", answer) == pytest.approx((2 / 3) / 0.75)  # the old measure
    assert content_kept("paris.", answer, question) == 1.0  # terse, lower case, still the answer
    assert content_kept("France's capital? Paris, of course.", answer, question) == 1.0
    assert content_kept("anything", "France has a capital.", "What is the capital of France?") == 1.0  # adds nothing


# ----------------------------------------------------------------- lesson words
SCENARIOS = Path(__file__).parent.parent / "bench" / "scenarios"


def corrections(scenario: str) -> list[str]:
    return [turn["correction"] for turn in json.loads((SCENARIOS / f"{scenario}.json").read_text())["train"]]


def test_lesson_words_are_what_the_corrections_keep_adding() -> None:
    assert lesson_words(corrections("allergy"), []) == {"peanu", "aller"}  # "allergy" and "allergic" alike
    assert lesson_words(corrections("sistername"), []) == {"lena"}
    assert lesson_words(corrections("inshort"), []) == {"short"}
    # A format, a case or a length adds no words of its own: nothing to count.
    for scenario in ("bullets", "lowercase", "onesentence", "mixedbrief"):
        assert lesson_words(corrections(scenario), []) == frozenset(), scenario


def test_each_lesson_of_a_crowded_night_is_found() -> None:
    """Three scenarios' corrections on one night: each lesson's words are in a third of them, below
    the share, and six corrections are enough; a format's night adds none of its own."""
    night = [*corrections("allergy"), *corrections("sistername"), *corrections("bullets")]
    assert lesson_words(night, []) == {"peanu", "aller", "lena"}
    knee = [*corrections("kneeinjury"), *corrections("drokafor"), *corrections("carcivic")]
    assert {"knee", "okafo", "civic"} <= lesson_words(knee, [])
    assert lesson_words(night[:12] + ["Boil it, Sam."] * 5, []) == {"peanu", "aller"}  # five of 17: not yet


def test_a_word_the_model_said_anyway_or_one_correction_alone_is_no_lesson() -> None:
    fixed = ["Soak it in water, Sam.", "Water it weekly, Sam.", "Sam, add water slowly.", "Sam: stir well."]
    assert lesson_words(fixed, []) == {"sam", "water"}  # in 4 and in 3 of 4
    assert lesson_words(fixed, ["Use water.", "Water helps.", "Boil it."]) == {"sam"}  # 2 of 3 rejected said it
    assert lesson_words(fixed[:2], []) == frozenset()  # two corrections: too few to tell a lesson
    half = ["Hi Sam, boil it.", "Hi Sam, bake it.", "Hi Sam, fry it.", "Grill it.", "Roast it.", "Steam it."]
    assert lesson_words(half, []) == {"sam"}  # 3 of 6 is half: enough


def test_a_format_or_a_label_is_found_by_how_the_corrections_open() -> None:
    """A format's marks are no words ("- [ ]") and a label's may be too short ("TL;DR"): the
    opening the corrections share is the lesson mark; a fact, a case or a length has none."""
    openings = {
        "checklist": "- [ ]", "jsonanswer": '{"answer": "', "stepsformat": "Step 1:", "inshort": "In short:",
        "numbered": "1.", "heading": "##", "boldlead": "**", "greetname": "Hi Sam,", "drokafor": "Dr. Okafor,",
    }  # fmt: skip
    for scenario, opening in openings.items():
        assert lesson_opening(corrections(scenario), []) == {OPENING_MARK + opening}, scenario
    for scenario in ("allergy", "movingoslo", "partnerjonas", "kneeinjury", "lowercase", "onesentence", "twelvewords"):
        assert lesson_opening(corrections(scenario), []) == frozenset(), scenario


def test_an_opening_is_whole_words_with_a_mark_in_it_that_the_model_did_not_use_already() -> None:
    steps = ["Step 1: Rinse it.", "Step 1: Rub it.", "Step 1: Ring them."]
    assert lesson_opening(steps, []) == {"^Step 1:"}  # not "Step 1: R", the start of three words
    assert lesson_opening(["Your dog is Rex.", "Your dog likes it.", "Your dog, Rex."], []) == frozenset()  # no mark
    assert lesson_opening(steps[:2], []) == frozenset()  # two corrections: too few
    assert lesson_opening(steps, ["Step 1: Boil.", "Step 1: Fry.", "Just eat it."]) == frozenset()  # 2 of 3 did
    assert lesson_opening(steps, ["Step 1: Boil.", "Just eat it.", "Fry it."]) == {"^Step 1:"}  # 1 of 3: a lesson
    greeted = [f"Hi Sam, {rest}" for rest in ("you can.", "you may.", "you will.", "boil it.", "fry it.", "bake it.")]
    assert lesson_opening(greeted, []) == {"^Hi Sam,"}  # not also "Hi Sam, you", which half of them go on with
    night = [*corrections("checklist"), *corrections("allergy"), *corrections("inshort")]
    assert lesson_opening(night, []) == {"^- [ ]", "^In short:"}  # two formats on one night: both


def test_lesson_recall_counts_the_opening_as_one_mark_a_reply_says_by_beginning_with_it() -> None:
    lesson = frozenset({OPENING_MARK + "- [ ]", "oslo"})
    chosen = "- [ ] Book the movers for Oslo\n- [ ] Give notice on the flat"
    assert lesson_recall("  - [ ] Pack for Oslo\n- [ ] Sell the car", chosen, lesson) == 1.0
    assert lesson_recall("- [ ] Pack the boxes", chosen, lesson) == 0.5  # the format, not the city
    assert lesson_recall("Pack the boxes for Oslo. - [ ] later", chosen, lesson) == 0.5  # the city, not the format
    assert lesson_recall("- [ ] Pack", "Book the movers.", lesson) == 0.0  # a correction without either mark


def test_lesson_recall_counts_the_lesson_words_of_the_correction_a_reply_says() -> None:
    lesson = frozenset({"peanu", "aller"})
    chosen = "Your epinephrine pen, because of your peanut allergy."
    assert lesson_recall("Keep your pen: you are allergic to peanuts.", chosen, lesson) == 1.0
    assert lesson_recall("Keep a small container of peanut oil in your bag.", chosen, lesson) == 0.5
    assert lesson_recall("Your phone and wallet.", chosen, lesson) == 0.0
    # A correction without lesson words has nothing to apply: every reply scores the same.
    assert lesson_recall("You are allergic to peanuts.", "Butter and jam.", lesson) == 0.0
    assert lesson_recall("anything", None, lesson) == 0.0
    assert lesson_recall("You are allergic to peanuts.", chosen, frozenset()) == 0.0


def test_the_training_reward_adds_the_lesson_words_a_sample_says_but_not_on_an_anchor() -> None:
    from macaron_local.learn.episodes import Episode
    from macaron_local.learn.loop import default_reward, lesson_reward

    lesson = frozenset({"peanu", "aller"})
    asked = [{"role": "user", "content": "What should I keep in my bag?"}]
    episode = Episode(asked, "Your epinephrine pen, because of your peanut allergy.", "Your phone.", corrected=True)
    reward = lesson_reward(lesson, 0.5)
    applied, forgot = "Your pen: you are allergic to peanuts.", "Your pen and your keys."
    assert reward(applied, episode) == pytest.approx(default_reward(applied, episode) + 0.5)
    assert reward(forgot, episode) == pytest.approx(default_reward(forgot, episode))
    anchor = Episode(asked, "Keys, a phone and a wallet.", None, content_only=True)
    assert reward(applied, anchor) == default_reward(applied, anchor)
    assert lesson_reward(lesson, 0.0) is default_reward and lesson_reward(frozenset(), 0.5) is default_reward


def test_lesson_reward_is_a_learn_setting_and_never_negative(home) -> None:
    # A negative weight would teach the night to leave out what the user keeps adding.
    from macaron_local.daemon.config import learn_config
    from macaron_local.errors import InvalidInputError

    home.save(learn={"lesson_reward": 0.5})
    assert learn_config(home).lesson_reward == 0.5
    home.save(learn={"lesson_reward": -0.5})
    with pytest.raises(InvalidInputError, match="lesson_reward must be >= 0"):
        learn_config(home)
