"""Anchor episodes: everyday questions answered by the bare experts, replayed as "answer as before"."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from macaron_local.engine import Engine, EngineConfig, GenerationParams
from macaron_local.learn.anchors import ANCHOR_TOKENS, anchor_prompts, answer_anchors, pick_anchors
from macaron_local.learn.episodes import Episode
from macaron_local.learn.lesson_guard import lesson_questions
from macaron_local.learn.loop import LearnConfig, completion_tokens, default_reward, member_text, sample_step
from macaron_local.learn.regression import load_regression_set
from macaron_local.learn.rewards import content_kept, first_sentence, preference_reward

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from common import embedded_model  # noqa: E402

ROOT = Path(__file__).parents[1]


def test_the_pool_shares_nothing_with_the_regression_set_or_the_scenarios():
    """Neither the anchors nor the lesson guard's everyday requests (learn/lesson_guard.py) may
    be a prompt the gate or a benchmark judges on: a night would train on its own exam."""
    pool = {p.lower() for p in anchor_prompts()}
    assert len(pool) == len(anchor_prompts()) >= 24
    pool |= {q.messages[-1]["content"].lower() for q in lesson_questions(10_000, 0, "")}
    assert len(pool) >= 24 + 32
    judged = {q["question"].lower() for q in load_regression_set()["questions"]}
    scenario_prompts = set()
    for folder in (ROOT / "bench" / "scenarios", ROOT.parent / "shared" / "scenarios"):
        for path in folder.glob("*.json") if folder.is_dir() else []:
            scenario = json.loads(path.read_text())
            scenario_prompts |= {t["prompt"].lower() for t in scenario.get("train", [])}
            scenario_prompts |= {p.lower() for p in scenario.get("heldout", [])}
    assert not pool & judged and not pool & scenario_prompts


def test_how_many_grows_with_the_nights_new_feedback_and_each_night_draws_anew():
    assert pick_anchors(0, 0.5, 0, "sys") == [] and pick_anchors(10, 0.0, 0, "sys") == []
    first = pick_anchors(9, 0.5, 0, "Be kind.")
    assert len(first) == 5 and len(pick_anchors(1000, 0.5, 0, "")) == len(anchor_prompts())
    assert all(a.messages[0] == {"role": "system", "content": "Be kind."} for a in first)
    assert all(a.chosen is None and a.feedback_ids == [] for a in first)  # not the user's data
    assert [a.messages for a in pick_anchors(9, 0.5, 1, "Be kind.")] != [a.messages for a in first]
    assert LearnConfig().anchor_ratio == 1.0  # on by default; [learn] anchor_ratio = 0 turns them off


def test_an_anchor_is_answered_as_the_bare_experts_answer_it():
    [anchor] = pick_anchors(1, 1.0, 3, "You are a helpful assistant.")
    with Engine(EngineConfig(model_path=embedded_model(), n_ctx=512, n_threads=2)) as engine:
        [answered] = answer_anchors(engine, [anchor], lambda slot: [])
        params = GenerationParams(max_tokens=ANCHOR_TOKENS, temperature=0.0, repeat_penalty=1.1)
        expected = engine.generate(engine.render_tokens(anchor.messages), params).text.strip()
    assert answered.chosen == expected and answered.chosen
    assert answered.messages == anchor.messages and answered.rejected is None
    assert answered.content_only and not anchor.content_only


def test_an_anchor_guards_content_and_is_never_imitated_verbatim():
    """Its bare answer's first sentence joins the group with full reward but gets no SFT row (a
    correction does), so it cannot outvote a style or a length the user taught; samples are
    scored by content_kept."""
    [anchor] = pick_anchors(1, 1.0, 5, "You are a helpful assistant.")
    config = LearnConfig(group_size=2, episodes_per_step=1)
    with Engine(EngineConfig(model_path=embedded_model(), n_ctx=512, n_threads=2)) as engine:
        [answered] = answer_anchors(engine, [anchor], lambda slot: [])
        correction = Episode(answered.messages, chosen="Hi Sam, " + answered.chosen, rejected=answered.chosen)
        as_anchor = sample_step(engine, [answered], "", 0, config, default_reward)
        as_correction = sample_step(engine, [correction], "", 0, config, default_reward)
        _, first = completion_tokens(engine, answered.messages, first_sentence(answered.chosen))
        _, whole = completion_tokens(engine, answered.messages, correction.chosen)
    assert as_anchor.completions[-1] == first
    assert as_correction.completions[-1] == whole  # a correction joins whole
    assert as_anchor.is_correction == [False, False, False]
    assert as_correction.is_correction == [False, False, True]
    [rewards] = as_anchor.rewards
    assert rewards[-1] == 1.0 and all(0.0 <= r <= 1.0 for r in rewards)  # the bare answer keeps its content
    greeted = "Hi Sam, " + answered.chosen.lower()
    assert default_reward(greeted, answered) == 1.0 == content_kept(greeted, answered.chosen)
    assert default_reward(greeted, correction) == preference_reward(greeted, correction.chosen, correction.rejected)


def test_the_member_beside_the_samples():
    """A correction joins whole; a rating joins as the reply rated; an anchor joins as its
    first sentence, the part `content_kept` judges, so its length is not taught."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    bare = "The capital of France is Paris. It is known for the Eiffel Tower and its museums."
    anchor = Episode(messages, chosen=bare, rejected=None, content_only=True)
    assert member_text(anchor) == "The capital of France is Paris."
    assert member_text(Episode(messages, chosen=bare, rejected="Lyon.")) == bare
    assert member_text(Episode(messages, chosen=None, rejected="Lyon.")) == "Lyon."
