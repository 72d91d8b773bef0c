"""What a night learns from and is judged on (learn.plan), and the gate's statistics, without a
model: new vs learned feedback, stable held-out sets, bounded replay that revisits everything,
a night's cost bounded by its new feedback."""

from __future__ import annotations

import math

from macaron_local.learn.episodes import Episode
from macaron_local.learn.gate import significantly_better, significantly_worse
from macaron_local.learn.loop import LearnConfig
from macaron_local.learn.plan import night_steps, plan_night, planned_steps, rotating_sample, tonights_lesson
from macaron_local.store import LearningRun


def episodes(first: int, n: int, slot: str = "L0") -> list[Episode]:
    return [Episode([], f"good {i}", f"bad {i}", slot, [i], conversation_id=f"c{i}") for i in range(first, first + n)]


def run(plan, decision: str = "deployed", tainted: bool = False) -> LearningRun:
    metrics = {"heldout_conversations": plan.new_heldout_conversations}
    return LearningRun("r", "", None, "personal", "done", decision, "", plan.feedback_ids, metrics, None, tainted, None)


def test_nights_keep_their_held_out_sets_and_replay_a_bounded_sample():
    config = LearnConfig()
    night1 = plan_night(episodes(1, 12), [], config)
    assert len(night1.held_new) == 3 and len(night1.new_train) == 9 and not night1.replay and not night1.held_old
    runs = [run(night1)]
    night2 = plan_night(episodes(1, 22), runs, config)
    # Night 1's held-out conversations are judged as "must hold", never trained on.
    assert {e.conversation_id for e in night2.held_old} == set(night1.new_heldout_conversations)
    assert not {e.conversation_id for e in night2.train} & set(night1.new_heldout_conversations)
    assert {e.feedback_ids[0] for e in night2.new_train} <= set(range(13, 23))
    assert len(night2.new_train) + len(night2.held_new) == 10 and len(night2.held_new) >= 1
    assert len(night2.replay) == len(night2.new_train)  # replay_ratio 1, from night 1's trained
    assert {e.feedback_ids[0] for e in night2.replay} <= {e.feedback_ids[0] for e in night1.new_train}


def test_a_rejected_or_tainted_night_leaves_its_feedback_new():
    config = LearnConfig()
    night1 = plan_night(episodes(1, 12), [], config)
    for history in ([run(night1, "rejected")], [run(night1, tainted=True)]):
        again = plan_night(episodes(1, 12), history, config)
        assert {e.conversation_id for e in again.new_train} == {e.conversation_id for e in night1.new_train}
        assert not again.replay and not again.held_old
    # A night with nothing new is skipped, whatever the history.
    assert plan_night(episodes(1, 12), [run(night1)], config).skipped == "no new feedback to learn from"


def test_rotating_replay_revisits_every_old_episode_within_the_stated_bound():
    old = episodes(1, 40, "L0") + episodes(41, 20, "L1")
    n = 9
    bound = math.ceil(len(old) / n) + 1  # ceil(n_s / k_s) per stratum, rounding included
    seen: set[int] = set()
    for night in range(bound):
        sample = rotating_sample(old, n, night)
        assert len(sample) <= n
        seen |= {e.feedback_ids[0] for e in sample}
    assert seen == set(range(1, 61))
    picked = rotating_sample(old, n, 0)
    assert sum(e.slot == "L1" for e in picked) == 3  # a third of the pool is L1: a third of the sample


def test_a_nights_cost_depends_on_its_new_feedback_not_on_history():
    config = LearnConfig()
    small = plan_night(episodes(1, 60), [], config)
    runs = [run(small)]
    later = plan_night(episodes(1, 70), runs, config)  # 10 new on top of 60 old
    huge = plan_night(episodes(1, 1010), [run(plan_night(episodes(1, 1000), [], config))], config)
    assert len(later.train) == len(huge.train) <= 2 * 10
    assert later.steps == huge.steps <= config.steps
    assert len(huge.held_old) <= config.max_old_heldout
    assert night_steps(3, 24, 8, 6.0, 2) == 9 and night_steps(1, 24, 8, 6.0, 2) == 8
    assert night_steps(99, 24, 8, 6.0, 2) == 24


def test_a_night_runs_the_steps_a_lesson_needs_but_no_episode_too_often():
    config = LearnConfig()
    shipped = (config.steps, config.min_steps, config.visits_per_episode, config.episodes_per_step)
    assert shipped == (108, 72, 6.0, 2) and config.max_visits_per_episode == 12.0
    # one lesson: 9 corrections and 9 anchors want 54 steps at six visits; the floor gives 72
    assert night_steps(18, *shipped, 12.0) == 72
    assert night_steps(24, *shipped, 12.0) == 72  # six visits reach the floor
    assert night_steps(30, *shipped, 12.0) == 90  # above it, visits decide as before
    assert night_steps(81, *shipped, 12.0) == 108  # three lessons: the cap
    # three corrections and their anchors: 12 visits each make the floor, not 24
    assert night_steps(6, *shipped, 12.0) == 36 and night_steps(1, *shipped, 12.0) == 6
    plan = plan_night(episodes(1, 12), [], config)
    assert len(plan.new_train) == 9 and plan.steps == 54  # 12 visits each to 9 (anchors come later)
    plan.anchors = episodes(100, 9)  # as run.py adds them, then counts the steps again
    assert planned_steps(plan, config) == 72


def test_forgetting_is_judged_against_noise_not_a_single_count():
    assert not significantly_worse([0.5, 0.4, 0.6], [0.5, 0.5, 0.5])  # noise around no change
    assert significantly_worse([0.1, 0.1, 0.12, 0.1], [0.6, 0.62, 0.6, 0.6])  # a real, consistent drop
    assert not significantly_worse([], [])


def test_a_gain_must_clear_a_margin_and_the_noise():
    before = [-0.3, -0.3, -0.3, -0.3]
    assert not significantly_better([-0.29, -0.28, -0.29, -0.29], before)  # gibberish's near-inert gain
    assert significantly_better([0.1, 0.0, 0.2, -0.1], before)  # a consistent gain of 0.35
    assert not significantly_better([0.9, -0.35, -0.3, -0.3], before)  # one lucky reply: within one SE
    assert significantly_better([0.0], [-0.3]) and not significantly_better([], [])


def test_tonights_lesson_comes_from_the_users_own_words_trained_or_held_out():
    def told(i: int, text: str, corrected: bool = True) -> Episode:
        return Episode([], text, f"reply {i}", "L0", [i], conversation_id=f"c{i}", corrected=corrected)

    night = [told(i, f"Lena says hello, answer {i}.") for i in range(1, 7)]
    night += [told(i, f"Liked reply {i} about Biscuit.", corrected=False) for i in range(7, 15)]  # sampled, not written
    plan = plan_night(night, [], LearnConfig())
    assert plan.held_new and plan.new_train
    # Every correction has the words, and opens the same way; no "biscu".
    assert tonights_lesson(plan) == {"lena", "says", "hello", "answe", "^Lena says hello, answer"}
    learned = run(plan)
    tomorrow = plan_night(
        [*night, told(20, "Sam, boil it."), told(21, "Sam, bake it."), told(22, "Sam, fry it.")],
        [learned],
        LearnConfig(),
    )
    assert tonights_lesson(tomorrow) == {"sam", "^Sam,"}  # only what is new tonight
