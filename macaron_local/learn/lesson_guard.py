"""What earlier nights taught, held while tonight learns something else.

Each night's corrections are written without the earlier nights' lessons: a user who taught
bulleted answers last night corrects tonight's job questions in plain sentences, and each
rejected reply is the deployed version's, bullets and all. Every group then ranks the
correction above the bulleted samples, so the night pushes the style away; replaying the old
corrections holds it on their own prompts, not on new ones. Measured on the embedded model
(bullets, then a job): the style fell from 8 of 8 held-out prompts to 5 of 8.

So a night that continues a deployed version can also hold that version's lessons on everyday
requests: `count` drawn each night from everyday.json (advice, how-to, explanations, writing)
and the anchors' questions about the world. The deployed version answers each greedily,
as served; the tokens it *taught* in that answer (retention.taught_masks: likely under it and
at least 1 nat above the bare experts, such as the leading "- ", the greeting, a fact) become a
guarded row (learn/guards.py) held one-sided to the night's starting point. Only those tokens
count, so the rest of the answer (its content, its length) is free to move, and a new style
the night teaches is opposed only where it contradicts an earlier one.

It is off by default (`LearnConfig.lesson_weight` 0). Re-running three second nights from their
night-1 state, it kept bullets better (0.625 -> 0.875 of 8 prompts). But it lost a greeting
prompt in one of two greeting runs and held the new fact to 0.875 instead of 1.0 in both, and
more candidates lost factual answers. So on this evidence it does not earn a place in the
default.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from importlib import resources

import numpy as np

from macaron_local.engine import Engine
from macaron_local.learn.anchors import anchor_prompts, greedy_replies, question_episodes
from macaron_local.learn.backends.base import Batch, TrainerBackend
from macaron_local.learn.episodes import Episode
from macaron_local.learn.guards import RowGuard
from macaron_local.learn.loop import adapts, logprobs_at
from macaron_local.learn.retention import Stack, logprobs_under, taught_masks


def lesson_questions(count: int, night: int, system_prompt: str) -> list[Episode]:
    """`count` everyday requests (a different draw each night), as the chat would send them."""
    text = resources.files("macaron_local.learn.data").joinpath("everyday.json").read_text("utf-8")
    pool = [*json.loads(text)["prompts"], *anchor_prompts()]
    return question_episodes(random.Random(night).sample(pool, min(count, len(pool))), system_prompt)


class LessonGuard(RowGuard):
    """Taught tokens of the deployed version's answers, held to the LoRA the night started from."""

    name = "lessons"
    start: dict[str, np.ndarray] | None = None
    active = True  # `begin` turns it off for a night that starts from zero

    def begin(self, start: dict[str, np.ndarray] | None) -> None:
        """Hold to `start`; a night that did not start from a learned version has no lessons."""
        self.start = start
        self.active = adapts(start)
        self._reference.clear()

    def indices(self, step: int, group: str = "") -> list[int]:
        return super().indices(step, group) if self.active else []

    def reference(self, backend: TrainerBackend, batch: Batch):
        return backend.asarray(logprobs_at(backend, batch, self.start or {}))


def lesson_guard(
    engine: Engine,
    questions: Sequence[Episode],
    bare: Stack,
    deployed: Stack,
    group_of: Callable[[Episode], str],
    per_step: int,
    weight: float,
) -> LessonGuard:
    """The guard for `questions` (episodes whose `messages` end with the user's question): each
    answered greedily under `deployed`, its taught tokens found against `bare`. Answers with no
    taught token are left out (the deployed version did not change them)."""
    answered = []
    for question, (prompt, done) in zip(questions, greedy_replies(engine, questions, deployed), strict=True):
        completion = done.tokens + ([done.stop_token] if done.stop_token is not None else [])
        if completion:
            answered.append((question, (prompt, completion)))
    samples = [(q.slot, tokens) for q, tokens in answered]
    masks = taught_masks(logprobs_under(engine, deployed, samples), logprobs_under(engine, bare, samples))
    kept = [(group_of(q), p, c, m) for (q, (p, c)), m in zip(answered, masks, strict=True) if m.any()]
    return LessonGuard.from_masked(kept, per_step, weight)
