"""Corrections imitated as often on a crowded night as on a night of their own.

A night's size follows its feedback (learn/plan.py): about `visits_per_episode` visits to each
episode, at most `LearnConfig.steps` steps, because every visit samples replies through the
engine and scores them, and that is what a night's time goes to. Three lessons on one night
(33 corrections and as many anchors) hit the cap at 3.3 visits each, where a lesson taught
alone gets 6 to 8, and the lesson that needs the most repetition loses: a bad knee applied to
advice served 0.375 beside an address and a car (stop 48) and 0.875 alone. What a visit adds
to a fact is mostly its SFT row (the correction as a group member), and an SFT row alone costs
one row of the batch with no sampling.

So where the cap leaves a night's corrections fewer than `imitation_visits` visits, each step
also scores the next corrections of its expert group as plain SFT rows (`losses.sft_loss`,
weighted as the group member's is), dealt evenly: every correction is imitated about
`imitation_visits` times, and the costly visits stay capped. A night under the cap adds
nothing. Anchors are never imitated (they guard content, not form) and get no rows here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import numpy as np

from macaron_local.engine import Engine
from macaron_local.learn import losses
from macaron_local.learn.backends.base import Batch, TrainerBackend
from macaron_local.learn.episodes import Episode
from macaron_local.learn.guards import RowGuard, Term
from macaron_local.learn.loop import completion_tokens


def rows_per_step(n_episodes: int, n_imitated: int, steps: int, episodes_per_step: int, visits: float) -> int:
    """SFT rows each step adds so that `n_imitated` corrections among a night's `n_episodes`
    reach about `visits` imitations each over `steps` steps of `episodes_per_step` visits."""
    if n_episodes == 0 or n_imitated == 0 or steps <= 0 or visits <= 0:
        return 0
    full = steps * episodes_per_step / n_episodes
    missing = visits - full
    if missing <= 1e-9:
        return 0
    return math.ceil(missing * n_imitated / steps)


class ImitationGuard(RowGuard):
    """The night's corrections as extra SFT rows (the module docstring says when and why).

    Not a guard in the one-sided sense: its term is the corrections' plain NLL. It shares the
    guards' plumbing (rows appended to the step's batch, a weighted term, `begin` per run).
    Each expert group deals its own shuffled deck, so within a group the rows differ by at
    most one per correction; the deal is seeded and starts over at `begin` (a retrain)."""

    name = "imitation"

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        groups: Sequence[str],
        per_step: int,
        weight: float,
        seed: int = 0,
    ) -> None:
        super().__init__(prompts, completions, per_step, weight, groups=groups)
        self._seed = seed
        self.begin(None)

    def begin(self, start: dict[str, np.ndarray] | None) -> None:
        self._rng = random.Random(self._seed)
        self._decks: dict[str, list[int]] = {}
        self._dealt: dict[tuple[int, str], list[int]] = {}
        self.rows_dealt = 0

    def indices(self, step: int, group: str = "") -> list[int]:
        key = (step, group)
        if key not in self._dealt:  # rows() and term() ask for the same step: deal once
            self._dealt[key] = self._deal(group)
            self.rows_dealt += len(self._dealt[key])
        return self._dealt[key]

    def _deal(self, group: str) -> list[int]:
        mine = [i for i, g in enumerate(self.groups) if g == group]
        if not mine or not self.per_step:
            return []
        deck = self._decks.setdefault(group, [])
        dealt = []
        for _ in range(min(self.per_step, len(mine))):
            if not deck:
                deck.extend(mine)
                self._rng.shuffle(deck)
            dealt.append(deck.pop())
        return dealt

    def term(self, backend: TrainerBackend, batch: Batch, step: int, group: str) -> Term:
        def imitation_term(logp, mask_arr):
            return losses.sft_loss(logp, mask_arr)

        return imitation_term


def imitation_guard(
    engine: Engine,
    episodes: Sequence[Episode],
    steps: int,
    episodes_per_step: int,
    visits: float,
    weight: float,
    group_of: Callable[[Episode], str],
    seed: int = 0,
) -> ImitationGuard:
    """The guard for a night that trains `episodes` for `steps` steps: no rows where the
    night's visits already reach `visits` (or `weight` is 0)."""
    usable = [e for e in episodes if e.has_verdict]
    chosen = [e for e in usable if e.imitated]
    per_step = rows_per_step(len(usable), len(chosen), steps, episodes_per_step, visits)
    if per_step == 0 or weight <= 0:
        return ImitationGuard([], [], [], 0, weight, seed)
    pairs = [completion_tokens(engine, e.messages, e.chosen or "") for e in chosen]
    return ImitationGuard(
        [p for p, _ in pairs], [c for _, c in pairs], [group_of(e) for e in chosen], per_step, weight, seed
    )
