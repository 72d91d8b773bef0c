"""Balanced draws (learn/draws.py): every episode visited as often as every other, each group
its share of the steps, seeded so the two memory plans deal the same night."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from macaron_local.learn.draws import EpisodeDraws
from macaron_local.learn.episodes import Episode


def episodes(n: int, tag: str) -> list[Episode]:
    return [Episode([{"role": "user", "content": f"{tag} {i}"}], f"{tag} answer {i}", None) for i in range(n)]


def deal_night(groups: dict, steps: int, per_step: int, seed: int = 0) -> tuple[Counter, Counter]:
    draws = EpisodeDraws(groups, random.Random(seed))
    visits: Counter = Counter()
    steps_of: Counter = Counter()
    for _ in range(steps):
        group = draws.next_group()
        steps_of[group] += 1
        for episode in draws.deal(group, per_step):
            visits[episode.messages[0]["content"]] += 1
    return visits, steps_of


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_every_episode_of_a_group_is_visited_within_one_of_every_other(seed):
    visits, _ = deal_night({"": episodes(54, "a")}, steps=108, per_step=2, seed=seed)
    assert len(visits) == 54 and set(visits.values()) == {4}
    visits, _ = deal_night({"": episodes(27, "a")}, steps=20, per_step=2, seed=seed)  # 40 of 27: 1 or 2 each
    assert len(visits) == 27 and set(visits.values()) <= {1, 2} and sum(visits.values()) == 40


def test_groups_get_their_share_of_the_steps_exactly():
    groups = {"L0": episodes(30, "chat"), "L1": episodes(10, "agent"), "L2": episodes(20, "code")}
    visits, steps_of = deal_night(groups, steps=60, per_step=2)
    assert steps_of == {"L0": 30, "L1": 10, "L2": 20}
    assert set(visits.values()) == {2}  # 120 draws over 60 episodes, two each
    _, early = deal_night(groups, steps=7, per_step=2)
    assert abs(early["L0"] - 3.5) <= 1 and abs(early["L1"] - 7 / 6) <= 1 and abs(early["L2"] - 7 / 3) <= 1


def test_the_same_seed_deals_the_same_night_and_another_seed_another_order():
    groups = {"L0": episodes(9, "chat"), "L1": episodes(4, "agent")}

    def order(seed):
        draws = EpisodeDraws(groups, random.Random(seed))
        return [(g, [e.chosen for e in draws.deal(g, 2)]) for g in (draws.next_group() for _ in range(12))]

    assert order(3) == order(3)
    assert order(3) != order(4)


def test_a_group_smaller_than_a_step_repeats_and_an_empty_one_is_refused():
    [only] = episodes(1, "x")
    draws = EpisodeDraws({"": [only]}, random.Random(0))
    assert draws.deal(draws.next_group(), 3) == [only, only, only]
    with pytest.raises(ValueError):
        EpisodeDraws({"L0": []}, random.Random(0))
