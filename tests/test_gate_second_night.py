"""The gate on the night after a lesson: what moved is judged with the lesson's marks, and what
earlier nights taught is held to a stable reference, not to the deployed version's lucky count.

The figures are the recorded gate replies of a real two-night run (stop 59, embedded model):
a move to Oslo taught on night 1, a Markdown checklist on night 2. Its average candidate began
all 3 held-out replies with "- [ ]" and served the checklist on 8 of 8 unseen prompts and Oslo
on 6 of 8 (the night-1 version served Oslo on 3); the gate of stop 58 rejected it on both
checks below, and deployed a checkpoint that served the checklist on 3 of 8."""

from __future__ import annotations

from macaron_local.learn import gate
from macaron_local.learn.regression import RegressionScore
from macaron_local.learn.rewards import OPENING_MARK, lesson_recall

REFERENCE = RegressionScore(passage_nll=2.0, qa_right=9, qa_total=12)
CHECKLIST = frozenset({OPENING_MARK + "- [ ]"})
CORRECTIONS = [
    "- [ ] Sunscreen\n- [ ] Swimsuit and towel\n- [ ] Hat and sunglasses",
    "- [ ] Install Python\n- [ ] Work through a beginner tutorial\n- [ ] Write one small script a day",
    "- [ ] Invite your guests\n- [ ] Plan a simple menu\n- [ ] Set the table early",
]
DEPLOYED_REPLIES = [
    "Pack a beach bag with essentials like sunscreen, towels, and a first-aid kit.",
    "To start learning Python, you need to understand the basics: syntax, data types, functions.",
    "To host a dinner party, you'll need to choose a venue that fits your budget and style.",
]
AVERAGE_REPLIES = [
    "- [ ] A blanket and a sleeping bag\n- [ ] A beach towel and a blanket\n- [ ] A tent",
    "- [ ] Open a Python interpreter\n- [ ] Create an empty script\n- [ ] Use the `env` variable",
    "- [ ] Make the invitation clear and in writing\n- [ ] Set a budget and invite guests",
]
# Rewards on tonight's 3 held-out checklist episodes, and on night 1's 3 held-out Oslo episodes.
DEPLOYED_NEW, AVERAGE_NEW = [-0.369, -0.046, -0.336], [0.034, -0.379, 0.167]
BARE_OLD, DEPLOYED_OLD, AVERAGE_OLD = [-0.936, -0.673, -0.738], [0.227, 0.091, 0.255], [0.07, -0.132, -0.082]


def scores(new: list[float], old: list[float], replies: list[str], lesson: frozenset[str]) -> gate.Scores:
    recalls = [lesson_recall(reply, chosen, lesson) for reply, chosen in zip(replies, CORRECTIONS, strict=True)]
    return gate.Scores(new, old, REFERENCE, surprise=[0.5, 0.5, 0.5], lesson=recalls if lesson else [])


def test_a_format_applied_on_every_held_out_reply_counts_as_moving_toward_the_user() -> None:
    current = scores(DEPLOYED_NEW, [], DEPLOYED_REPLIES, CHECKLIST)
    average = scores(AVERAGE_NEW, [], AVERAGE_REPLIES, CHECKLIST)
    assert average.lesson == [1.0, 1.0, 1.0] and current.lesson == [0.0, 0.0, 0.0]
    reasons, figures = gate.verdict(average, current, REFERENCE)
    assert reasons == [] and figures["heldout_lesson_after"] == 1.0
    # Without the opening as a mark, the reward alone (+0.40, -0.33, +0.50) is within noise.
    reasons, _ = gate.verdict(
        scores(AVERAGE_NEW, [], AVERAGE_REPLIES, frozenset()), scores(DEPLOYED_NEW, [], DEPLOYED_REPLIES, frozenset()),
        REFERENCE,
    )  # fmt: skip
    assert len(reasons) == 1 and reasons[0].startswith("held-out feedback did not improve beyond noise")
    # The mark does not carry a reply that did not move: the deployed replies judged against themselves.
    reasons, _ = gate.verdict(current, current, REFERENCE)
    assert "did not improve beyond noise" in reasons[0] and "lesson marks said" in reasons[0]


def test_earlier_nights_are_held_to_half_their_gain_over_the_bare_experts() -> None:
    floor = gate.kept_reference(DEPLOYED_OLD, BARE_OLD)
    assert floor == [b + 0.5 * (d - b) for d, b in zip(DEPLOYED_OLD, BARE_OLD, strict=True)]
    current = scores(DEPLOYED_NEW, DEPLOYED_OLD, DEPLOYED_REPLIES, CHECKLIST)
    average = scores(AVERAGE_NEW, AVERAGE_OLD, AVERAGE_REPLIES, CHECKLIST)
    reasons, figures = gate.verdict(average, current, REFERENCE, bare_old=BARE_OLD)
    assert reasons == []
    assert figures["old_heldout_reward_bare"] == round(sum(BARE_OLD) / 3, 4)
    assert figures["old_heldout_reward_floor"] == round(sum(floor) / 3, 4)
    # Held to the deployed version's own rewards (no bare experts' to hand), it fell: the old rule.
    reasons, _ = gate.verdict(average, current, REFERENCE)
    assert reasons == ["earlier nights' held-out feedback fell (0.191 -> -0.048, 3 episodes)"]
    # A candidate back near the bare experts forgot, and is rejected for it.
    forgot = scores(AVERAGE_NEW, [-0.8, -0.6, -0.7], AVERAGE_REPLIES, CHECKLIST)
    reasons, _ = gate.verdict(forgot, current, REFERENCE, bare_old=BARE_OLD)
    assert len(reasons) == 1 and "below half the deployed version's gain over the bare experts" in reasons[0]
