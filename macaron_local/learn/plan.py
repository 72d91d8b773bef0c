"""What one night learns from, and what its gate judges on: pure functions of the episodes and
the learning runs recorded so far (no model), so every rule here is tested alone.

- **New** feedback is what no deployed, untainted run has learned yet (a rejected night's
  feedback is new again the next night; a forgotten conversation's runs are tainted, so what
  else they learned is new again and is retrained without it).
- **Held out** conversations are chosen once and stay held out: a new conversation is assigned
  when it first appears (a quarter of the new ones, when there are at least 4), and the runs
  record the assignment (`heldout_conversations` in their metrics). A conversation trained on
  once is never judged on later; one held out is never trained on.
- **Replay**: each night trains on its new episodes plus `ceil(replay_ratio * new)` older ones,
  drawn from each stratum (the expert that answered x the kind of signal) in proportion, by a
  rotating window: stratum s of n_s episodes gives k_s per night at offset night * k_s, so every
  older episode is revisited within ceil(n_s / k_s) nights.
- **Cost**: steps = min(steps, max(floor, ceil(visits * train / episodes_per_step))), floor =
  min(min_steps, ceil(max_visits * train / episodes_per_step)), with
  train = new + replay + anchors <= (1 + replay_ratio + anchor_ratio) * new: a function of the
  new feedback, capped, not of all history. The gate reads at most `max_old_heldout` of the earlier nights' held-out
  episodes (a rotating window too), so its cost is bounded as well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from macaron_local.learn.compose import Style
from macaron_local.learn.episodes import Episode
from macaron_local.learn.rewards import lesson_opening, lesson_words
from macaron_local.store import LearningRun

HELDOUT_SHARE = 0.25
MIN_CONVERSATIONS_TO_SPLIT = 4


@dataclass
class NightPlan:
    new_train: list[Episode] = field(default_factory=list)
    replay: list[Episode] = field(default_factory=list)
    held_new: list[Episode] = field(default_factory=list)  # not yet taught: must improve
    held_old: list[Episode] = field(default_factory=list)  # taught by deployed nights: must hold
    anchors: list[Episode] = field(default_factory=list)  # "answer as before" (learn/anchors.py)
    new_heldout_conversations: list[str] = field(default_factory=list)
    steps: int = 0
    night: int = 0
    skipped: str | None = None
    noisy: int = 0  # corrections left out as noise, not language (learn/fluency.py)
    lesson: frozenset[str] = frozenset()  # what tonight's corrections keep adding (`tonights_lesson`)
    styles: list[Style] = field(default_factory=list)  # styles composed into every correction (learn/compose.py)
    composed: int = 0  # trained corrections a composed style changed

    @property
    def train(self) -> list[Episode]:
        return [*self.new_train, *self.replay, *self.anchors]

    @property
    def feedback_ids(self) -> list[int]:
        episodes = [*self.train, *self.held_new, *self.held_old]
        return sorted({i for e in episodes for i in e.feedback_ids})


def tonights_lesson(plan: NightPlan) -> frozenset[str]:
    """The marks of what tonight's corrections keep adding, from every new one, trained or held
    out (the user wrote them all, and the held-out ones are judged by them): the words
    (`rewards.lesson_words`) and the opening (`rewards.lesson_opening`)."""
    tonight = [*plan.new_train, *plan.held_new]
    corrections = [e.chosen for e in tonight if e.corrected and e.chosen]
    rejected = [r for e in tonight for r in e.all_rejected]
    return lesson_words(corrections, rejected) | lesson_opening(corrections, rejected)


def _counted(run: LearningRun) -> bool:
    return run.status == "done" and not run.tainted


def learned_feedback(runs: Sequence[LearningRun]) -> set[int]:
    """Feedback ids some deployed, untainted run learned from."""
    return {i for r in runs if _counted(r) and r.decision == "deployed" for i in r.feedback_ids}


def heldout_conversations(runs: Sequence[LearningRun], deployed_only: bool = False) -> set[str]:
    return {
        c
        for r in runs
        if _counted(r) and (r.decision == "deployed" or not deployed_only)
        for c in r.metrics.get("heldout_conversations", [])
    }


def split_new(conversations: Sequence[str], share: float = HELDOUT_SHARE, seed: int = 0) -> set[str]:
    """Which of the new conversations to hold out: a quarter (at least one) once there are 4.
    Ranked by a hash of the id and the seed, so the choice does not depend on arrival order."""
    if len(conversations) < MIN_CONVERSATIONS_TO_SPLIT:
        return set()
    import hashlib

    ranked = sorted(conversations, key=lambda c: hashlib.sha256(f"{seed}:{c}".encode()).hexdigest())
    return set(ranked[: max(1, round(len(ranked) * share))])


def rotating_sample(episodes: Sequence[Episode], n: int, night: int) -> list[Episode]:
    """`n` of `episodes`, stratified by (slot, signal kind), each stratum a window that moves by
    its own size every night (see the module docstring for the revisit bound)."""
    if n <= 0 or not episodes:
        return []
    if n >= len(episodes):
        return list(episodes)
    strata: dict[tuple[str, str], list[Episode]] = {}
    for episode in sorted(episodes, key=lambda e: min(e.feedback_ids, default=0)):
        kind = "pair" if episode.chosen and episode.rejected else ("up" if episode.chosen else "down")
        strata.setdefault((episode.slot, kind), []).append(episode)
    picked: list[Episode] = []
    for members in strata.values():
        k = max(1, round(n * len(members) / len(episodes)))
        start = (night * k) % len(members)
        picked.extend(members[(start + i) % len(members)] for i in range(min(k, len(members))))
    return picked[:n] if len(picked) > n else picked


def night_steps(
    n_train: int, steps: int, min_steps: int, visits: float, episodes_per_step: int, max_visits: float | None = None
) -> int:
    """Training steps for a night of `n_train` episodes: `visits` visits each (learn/draws.py
    deals them evenly, so each is within one visit of that), at least
    `min_steps` (what a lesson needs to form, LearnConfig) where that is at most `max_visits`
    visits each (None: no bound), and at most `steps`."""
    per_step = max(1, episodes_per_step)
    wanted = math.ceil(visits * n_train / per_step)
    floor = min_steps if max_visits is None else min(min_steps, math.ceil(max_visits * n_train / per_step))
    return max(1, min(steps, max(floor, wanted)))


def plan_night(episodes: Sequence[Episode], runs: Sequence[LearningRun], config) -> NightPlan:
    """The night's training set, held-out sets and step count (`config` is a LearnConfig)."""
    night = sum(1 for r in runs if _counted(r))
    learned = learned_feedback(runs)
    seen_ids = {i for r in runs if _counted(r) for i in r.feedback_ids}
    held_before = heldout_conversations(runs)
    taught = heldout_conversations(runs, deployed_only=True)
    fresh = sorted({e.conversation_id for e in episodes if not set(e.feedback_ids) & seen_ids} - held_before)
    held_now = split_new(fresh, seed=config.seed)
    plan = NightPlan(night=night, new_heldout_conversations=sorted(held_now))
    old_train, held_old = [], []
    for episode in episodes:
        conversation = episode.conversation_id
        if conversation in held_now or (conversation in held_before and conversation not in taught):
            plan.held_new.append(episode)
        elif conversation in taught:
            held_old.append(episode)
        elif set(episode.feedback_ids) <= learned:
            old_train.append(episode)
        else:
            plan.new_train.append(episode)
    plan.held_old = rotating_sample(held_old, config.max_old_heldout, night)
    plan.replay = rotating_sample(old_train, math.ceil(config.replay_ratio * len(plan.new_train)), night)
    if not plan.new_train:
        plan.skipped = "no new feedback to learn from" if episodes else "nothing to learn from yet"
    elif not any(e.chosen for e in plan.train) and not any(e.rejected for e in plan.train):
        plan.skipped = "the new feedback carries no preference"
    elif not plan.held_new:
        plan.skipped = (
            f"{len(plan.new_train)} new episode(s) are too few to train and hold some out "
            f"(it takes {MIN_CONVERSATIONS_TO_SPLIT} new conversations); they wait for more"
        )
    plan.steps = planned_steps(plan, config)
    return plan


def planned_steps(plan: NightPlan, config) -> int:
    """The night's steps for its training set as it stands (anchors included once added)."""
    return steps_for(len(plan.train), config)


def steps_for(n_train: int, config) -> int:
    """`night_steps` for `n_train` episodes under a LearnConfig's night-size settings."""
    return night_steps(
        n_train,
        config.steps,
        config.min_steps,
        config.visits_per_episode,
        config.episodes_per_step,
        config.max_visits_per_episode,
    )
