"""A crowded night's extra SFT rows (learn/imitation.py): how many a step adds, that they are
dealt evenly within each expert group and never to anchors, and that they teach the corrections
more in the same number of steps on a tiny real model."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from macaron_local.learn.draws import EpisodeDraws
from macaron_local.learn.episodes import Episode
from macaron_local.learn.imitation import ImitationGuard, rows_per_step


def test_rows_per_step_tops_up_only_what_the_cap_left_out():
    # three lessons: 33 corrections + 33 anchors capped at 108 steps of 2 = 3.27 visits each
    assert rows_per_step(66, 33, 108, 2, 6.0) == 1  # (6 - 3.27) x 33 / 108 = 0.83 rows a step
    assert rows_per_step(66, 33, 108, 2, 9.0) == 2  # (9 - 3.27) x 33 / 108 = 1.75
    # one lesson: 9 corrections + 9 anchors at the 72-step floor are 8 visits each already
    assert rows_per_step(18, 9, 72, 2, 6.0) == 0
    assert rows_per_step(24, 12, 72, 2, 6.0) == 0  # exactly 6 visits: nothing missing
    assert rows_per_step(66, 33, 108, 2, 0.0) == 0  # off
    assert rows_per_step(66, 0, 108, 2, 6.0) == 0  # ratings only: nothing to imitate
    assert rows_per_step(0, 0, 108, 2, 6.0) == 0


def test_only_chosen_replies_that_are_not_anchors_are_imitated():
    ask = [{"role": "user", "content": "q"}]
    assert Episode(ask, "fixed", "bad").imitated
    assert Episode(ask, "liked", None).imitated
    assert not Episode(ask, None, "disliked").imitated
    assert not Episode(ask, "Paris.", None, content_only=True).imitated


def test_only_episodes_with_a_verdict_are_dealt():
    ask = [{"role": "user", "content": "q"}]
    assert Episode(ask, "fixed", None).has_verdict and Episode(ask, None, "bad").has_verdict
    assert not Episode(ask, None, None).has_verdict and not Episode(ask, "", "").has_verdict
    draws = EpisodeDraws.for_night([Episode(ask, None, None), Episode(ask, "fixed", None)], lambda e: "", seed=0)
    assert [e.chosen for e in draws.deal("", 3)] == ["fixed"] * 3  # the verdict-less one is never dealt
    with pytest.raises(ValueError, match="at least one episode"):
        EpisodeDraws.for_night([Episode(ask, None, None)], lambda e: "", seed=0)


def _guard(groups: list[str], per_step: int, seed: int = 0) -> ImitationGuard:
    prompts = [[1, i] for i in range(len(groups))]
    completions = [[10 + i, 2] for i in range(len(groups))]
    return ImitationGuard(prompts, completions, groups, per_step, weight=1.0, seed=seed)


def test_each_group_deals_its_own_corrections_evenly():
    groups = ["", "", "", "L1", "L1", ""]
    guard = _guard(groups, per_step=2)
    plain, agent = Counter(), Counter()
    for step in range(30):
        group = "L1" if step % 3 == 0 else ""
        picked = guard.indices(step, group)
        assert guard.indices(step, group) == picked  # rows() and term() see the same rows
        assert len(picked) == 2 and {groups[i] for i in picked} == {group}
        (agent if group == "L1" else plain).update(picked)
    assert sorted(plain) == [0, 1, 2, 5] and max(plain.values()) - min(plain.values()) <= 1
    assert sorted(agent) == [3, 4] and agent[3] == agent[4] == 10
    assert guard.rows_dealt == 60
    assert guard.indices(99, "L2") == []  # a group with no corrections gets no rows


def test_a_retrain_deals_the_same_rows_again_and_a_seed_changes_them():
    groups = [""] * 7
    first = _guard(groups, per_step=3)
    dealt = [first.indices(s) for s in range(5)]
    first.begin(None)
    assert [first.indices(s) for s in range(5)] == dealt and first.rows_dealt == 15
    assert [_guard(groups, per_step=3, seed=1).indices(s) for s in range(5)] != dealt
    assert first.rows(0) == ([[1, i] for i in dealt[0]], [[10 + i, 2] for i in dealt[0]])


def test_no_rows_without_weight_or_corrections():
    assert _guard([""], per_step=2).per_step == 2
    assert ImitationGuard([[1]], [[2]], [""], 2, weight=0.0).per_step == 0
    assert ImitationGuard([], [], [], 2, weight=1.0).rows(0) == ([], [])


def test_imitation_rows_teach_the_corrections_more_in_the_same_steps(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from tinymodels import TinyConfig, build_tiny_model, tiny_trainer

    from macaron_local.adapters import BaseModelInfo
    from macaron_local.engine import Engine, EngineConfig
    from macaron_local.learn.backends.base import make_batch
    from macaron_local.learn.imitation import imitation_guard
    from macaron_local.learn.loop import LearnConfig, completion_tokens, train

    tiny = build_tiny_model(tmp_path / "llama.gguf", TinyConfig(arch="llama", n_ctx_train=512))
    corrections = [
        Episode([{"role": "user", "content": "ab"}], "ba ba", "ab ab"),
        Episode([{"role": "user", "content": "cd"}], "dc dc", "cd cd"),
    ]
    anchors = [
        Episode([{"role": "user", "content": q}], a, None, content_only=True) for q, a in [("ef", "fe"), ("gh", "hg")]
    ]
    episodes = [*corrections, *anchors]
    backend = tiny_trainer(tiny, lr=2e-2)
    start = backend.lora_weights()
    base = BaseModelInfo.from_gguf(tiny.path)
    config = LearnConfig(steps=4, episodes_per_step=2, group_size=2, max_new_tokens=6, refresh_every=8, lr=2e-2)
    learned, logged = {}, {}
    with Engine(EngineConfig(model_path=tiny.path, n_ctx=256, n_threads=2)) as engine:
        chosen = make_batch(*zip(*[completion_tokens(engine, e.messages, e.chosen) for e in corrections], strict=True))
        mask = np.asarray(chosen.mask) > 0
        bare = backend.to_numpy(backend.logprobs(chosen))[mask].sum()
        # 4 steps x 2 over 4 episodes are 2 visits each: 6 asked for leaves 4 x 2 / 4 = 2 rows a step
        guard = imitation_guard(engine, episodes, 4, 2, 6.0, 1.0, lambda e: "")
        assert guard.per_step == 2 and len(guard.prompts) == 2  # the anchors are not imitated
        assert imitation_guard(engine, episodes, 4, 2, 2.0, 1.0, lambda e: "").per_step == 0
        for with_rows in (False, True):
            for name, values in start.items():
                backend.set_lora_weight(name, values)
            backend.reset_optimizer(config.lr)
            logs = []
            guards = [guard] if with_rows else ()
            train(backend, engine, base, episodes, config, tmp_path, guards=guards, on_step=logs.append)
            learned[with_rows] = backend.to_numpy(backend.logprobs(chosen))[mask].sum() - bare
            logged[with_rows] = [log.imitation for log in logs]
    assert guard.rows_dealt == 8
    assert logged[False] == [0.0] * 4 and min(logged[True]) > 0
    assert learned[True] > learned[False] + 0.5


def test_imitation_visits_is_a_learn_setting_and_never_negative(home):
    from macaron_local.daemon.config import learn_config
    from macaron_local.errors import InvalidInputError

    assert learn_config(home).imitation_visits == 6.0
    home.save(learn={"imitation_visits": 0})
    assert learn_config(home).imitation_visits == 0.0  # off: a crowded night adds no rows
    home.save(learn={"imitation_visits": -1})
    with pytest.raises(InvalidInputError, match="imitation_visits must be >= 0"):
        learn_config(home)
