"""Anchor episodes: "answer as before" on everyday questions, replayed next to the user's feedback.

A night that teaches a personal fact from short corrections ("You live in Lisbon.") also learns
a shortcut: answer questions with that fact. Measured on the embedded model, three facts and a
greeting taught in one night turned "What is the capital of Italy?" into "Lisbon is the capital
of Portugal." and "the capital of France" into "Biscuit, ...". Those candidates were rightly
rejected by the gate, and the night kept only its least-trained checkpoint, so nothing was learned.

Anchors give the learner the contrast it lacked. Each night, some questions about the world
(learn/data/anchors.json, which shares nothing with the regression set) are answered greedily
by the bare experts. They join the night's training set as episodes whose chosen reply is that
answer. So questions about the user get the user's facts, and the rest stay as they were.

An anchor guards content, not form (`Episode.content_only`): a sample is rewarded for keeping
what the bare answer's first sentence adds to the question (rewards.content_kept: "Paris", not
"capital" and "France", which any restatement keeps), and the answer is never
SFT-trained verbatim. Only that first sentence joins the sampled group (`loop.member_text`): the
whole answer, pulled toward whenever a sample lost the content, taught the bare experts' length
against a user who cut every reply to twelve words (3 of 8 held-out replies short enough, in
each of three runs; 7 of 8 and 3 of 8 with the first sentence, the misses one to seven words
over). Trained verbatim, anchors taught "no greeting, sentence case, this length" as strongly
as the user's corrections taught the opposite: on one night with a greeting and two
personal facts, the greeting reached 0.0 of held-out replies; guarding content only, 0.625 and
0.875 (two seeds), with both facts at 0.875 or more.
Anchors carry no feedback id. They are not the user's data, so forgetting never needs to reach
them. How many there are grows with the night's new feedback (`anchor_ratio`), every kind of it:
a night of dislikes alone pulls toward nothing, yet without anchors it lost the language
(stop 42, quicktake by ratings, 27 disliked answers and no anchors: passage NLL +26% and factual
answers 9 -> 0 at the final; every one of 15 candidates failed the gate). Pushed only away from
replies, the policy needs something it is held to.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from importlib import resources

from macaron_local.engine import AdapterHandle, Completion, Engine, GenerationParams
from macaron_local.learn.episodes import Episode
from macaron_local.router import route

ANCHOR_TOKENS = 48


def anchor_prompts() -> list[str]:
    text = resources.files("macaron_local.learn.data").joinpath("anchors.json").read_text()
    return list(json.loads(text)["prompts"])


def pick_anchors(n_new: int, ratio: float, night: int, system_prompt: str) -> list[Episode]:
    """`ceil(ratio * n_new)` anchor prompts (at most the pool), a different draw each night;
    their replies are filled in by `answer_anchors`."""
    pool = anchor_prompts()
    count = min(len(pool), math.ceil(ratio * n_new)) if ratio > 0 and n_new else 0
    return question_episodes(random.Random(night).sample(pool, count), system_prompt)


def question_episodes(questions: Sequence[str], system_prompt: str) -> list[Episode]:
    """Each question as the chat would send it (system prompt first), routed as the chat routes
    it, with no reply yet."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [
        Episode([*system, {"role": "user", "content": q}], chosen=None, rejected=None, slot=route(q).slot)
        for q in questions
    ]


def answer_anchors(
    engine: Engine, anchors: Sequence[Episode], stack: Callable[[str], Sequence[AdapterHandle]]
) -> list[Episode]:
    """Each anchor with the bare experts' greedy answer as its chosen reply (served as the chat
    serves it); an empty answer drops the anchor."""
    answered = []
    for anchor, (_, done) in zip(anchors, greedy_replies(engine, anchors, stack), strict=True):
        text = done.text.strip()
        if text:
            answered.append(Episode(anchor.messages, chosen=text, rejected=None, slot=anchor.slot, content_only=True))
    return answered


def greedy_replies(
    engine: Engine, questions: Sequence[Episode], stack: Callable[[str], Sequence[AdapterHandle]]
) -> list[tuple[list[int], Completion]]:
    """(prompt tokens, generation) of each question's greedy reply under its expert's `stack`,
    as the chat serves it, at most `ANCHOR_TOKENS` long (anchors and lesson_guard share it)."""
    params = GenerationParams(max_tokens=ANCHOR_TOKENS, temperature=0.0, repeat_penalty=1.1)
    replies = []
    for question in questions:
        engine.set_adapters(list(stack(question.slot)))
        prompt = engine.render_tokens(question.messages)
        replies.append((prompt, engine.generate(prompt, params)))
    engine.set_adapters([])
    return replies
