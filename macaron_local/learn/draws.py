"""Which episodes each training step trains on: every episode as often as every other.

A step trains `episodes_per_step` episodes of one group (the expert underneath is one for the
whole batch). Drawn with replacement, "about six visits each" was only an average: at 4 visits
each, about one episode in fifty was never trained on and others got eight, and a lesson carried
by a few episodes got what the dice gave it beside lessons carried by many. Here each group is a
deck, shuffled and dealt without replacement and shuffled again once dealt out, so within a
group the visits differ by at most one; and each step draws from the group furthest behind its
share of the steps (its share of the episodes), ties broken at random, so the groups get their
shares exactly rather than on average. Seeded: `train` and the sequential plan's `sample_night`
deal the same night.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from macaron_local.learn.episodes import Episode


class EpisodeDraws:
    """Deals a night's episodes, group by group, one step at a time."""

    def __init__(self, groups: dict[str, Sequence[Episode]], rng: random.Random) -> None:
        if not groups or not all(groups.values()):
            raise ValueError("every group needs at least one episode")
        self._rng = rng
        self._groups = {name: list(members) for name, members in sorted(groups.items())}
        total = sum(len(members) for members in self._groups.values())
        self._share = {name: len(members) / total for name, members in self._groups.items()}
        self._steps_of = dict.fromkeys(self._groups, 0)
        self._decks: dict[str, list[Episode]] = {name: [] for name in self._groups}
        self._steps = 0

    @classmethod
    def for_night(cls, episodes: Sequence[Episode], group_of: Callable[[Episode], str], seed: int) -> EpisodeDraws:
        """A night's deal: the episodes that carry a verdict (a chosen or a rejected reply),
        grouped by `group_of` (the expert each is trained under), seeded by `seed`."""
        usable = [e for e in episodes if e.has_verdict]
        if not usable:
            raise ValueError("learning needs at least one episode with a chosen or a rejected reply")
        groups: dict[str, list[Episode]] = {}
        for episode in usable:
            groups.setdefault(group_of(episode), []).append(episode)
        return cls(groups, random.Random(seed))

    def next_step(self, n: int) -> tuple[str, list[Episode]]:
        """The next step's group and its `n` episodes."""
        group = self.next_group()
        return group, self.deal(group, n)

    def next_group(self) -> str:
        """The group the next step draws from: the one furthest behind its share of the steps."""
        behind = {name: self._share[name] * (self._steps + 1) - self._steps_of[name] for name in self._groups}
        most = max(behind.values())
        tied = [name for name, gap in behind.items() if most - gap < 1e-9]
        name = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        self._steps += 1
        self._steps_of[name] += 1
        return name

    def deal(self, group: str, n: int) -> list[Episode]:
        """The next `n` episodes of `group`'s deck, shuffling a fresh deck whenever it runs out
        (a group smaller than `n` repeats within the step)."""
        deck = self._decks[group]
        dealt = []
        for _ in range(n):
            if not deck:
                deck.extend(self._groups[group])
                self._rng.shuffle(deck)
            dealt.append(deck.pop())
        return dealt
