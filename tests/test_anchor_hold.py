"""The anchors' known tokens held to the bare experts (learn/anchor_hold.py): which text and
which tokens are held (pure functions), the rows built on the embedded model as llama.cpp scores
them, and on a tiny real model, a night whose corrections pull an anchor's answer away held
back by the guard."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from macaron_local.learn.anchor_hold import KNOWN_MIN_P, AnchorHold, anchor_hold, held_text, known_mask
from macaron_local.learn.compose import Case, ClosingLine

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from common import embedded_model  # noqa: E402


def test_the_held_text_is_the_first_sentence_with_tonights_styles():
    answer = "The capital of Canada is Ottawa. It lies on the Ottawa River."
    assert held_text(answer, []) == "The capital of Canada is Ottawa."
    # in night_styles' order: the case last, so the closing line is cased too
    styled = held_text(answer, [ClosingLine("Anything else?", " "), Case(upper=False)])
    assert styled == "the capital of canada is ottawa. anything else?"
    assert held_text("Done.", [ClosingLine("Done.", " ")]) == "Done."  # a style it has is not added twice
    assert held_text("", [Case(upper=True)]) == ""


def test_only_known_tokens_of_the_text_are_held_and_never_the_first():
    sure, unsure = np.log(0.9), np.log(KNOWN_MIN_P / 2)
    bare = np.array([sure, sure, unsure, sure, sure, sure])
    # four text tokens, then the template's end of turn (two tokens) the bare experts are sure of
    assert known_mask(bare, 4).tolist() == [False, True, False, True, False, False]
    assert not known_mask(np.array([sure]), 1).any()  # a one-token answer has nothing to hold


def test_rows_are_built_from_the_embedded_models_own_answers():
    from macaron_local.engine import Engine, EngineConfig
    from macaron_local.learn.anchors import answer_anchors, question_episodes

    questions = question_episodes(
        ["What is the chemical symbol for gold?", "What is the opposite of hot?"], "You are a helpful assistant."
    )
    with Engine(EngineConfig(model_path=embedded_model(), n_ctx=512, n_threads=2)) as engine:
        answered = answer_anchors(engine, questions, lambda slot: [])
        guard = anchor_hold(engine, answered, [], lambda slot: [], lambda e: "", per_step=2, weight=1.0)
        assert guard.prompts == [engine.render_tokens(a.messages) for a in answered]
        held = [
            [engine.detokenize([t]) for t, m in zip(completion, mask, strict=True) if m]
            for completion, mask in zip(guard.completions, guard.masks, strict=True)
        ]
        off = anchor_hold(engine, answered, [], lambda slot: [], lambda e: "", per_step=2, weight=0.0)
    assert guard.per_step == 2 and guard.groups == ["", ""]
    assert all(mask[0] == 0 and mask[-1] == 0 for mask in guard.masks)  # the opening and the end of turn
    assert any(token.strip() == "Au" for token in held[0]), held[0]  # the fact the model is sure of
    assert off.per_step == 0 and off.prompts == []


def test_the_hold_keeps_an_anchors_known_tokens_near_the_bare_model_against_a_night(tmp_path):
    """A night that teaches the opposite of an anchor's answer, with and without the hold: the
    held tokens keep most of their bare log-probability with it, and the step logs the term."""
    pytest.importorskip("peft")
    from tinymodels import TinyConfig, build_tiny_model, tiny_trainer

    from macaron_local.adapters import BaseModelInfo
    from macaron_local.engine import Engine, EngineConfig
    from macaron_local.learn.backends.base import make_batch
    from macaron_local.learn.episodes import Episode
    from macaron_local.learn.loop import LearnConfig, completion_tokens, train

    tiny = build_tiny_model(tmp_path / "llama.gguf", TinyConfig(arch="llama", n_ctx_train=512))
    base = BaseModelInfo.from_gguf(tiny.path)
    backend = tiny_trainer(tiny, lr=3e-2)
    start = backend.lora_weights()
    config = LearnConfig(steps=10, episodes_per_step=1, group_size=2, max_new_tokens=6, refresh_every=5, lr=3e-2)
    question = [{"role": "user", "content": "ab"}]
    night = [Episode(messages=question, chosen="ba ba", rejected="ab ab")]
    with Engine(EngineConfig(model_path=tiny.path, n_ctx=256, n_threads=2)) as engine:
        prompt, completion = completion_tokens(engine, question, "ab ab")
        text_tokens = len(engine.tokenize("ab ab", add_bos=False, special=False))
        mask = [0.0] + [1.0] * (text_tokens - 1) + [0.0] * (len(completion) - text_tokens)
        rows = make_batch([prompt], [completion])
        held = np.asarray(rows.mask, dtype=bool)
        held[held] = np.asarray(mask, dtype=bool)
        bare = backend.to_numpy(backend.reference_logprobs(rows))[held].sum()
        lost, logged = {}, {}
        for holding in (False, True):
            for name, values in start.items():
                backend.set_lora_weight(name, values)
            backend.reset_optimizer(config.lr)
            guard = AnchorHold([prompt], [completion], per_step=1, weight=4.0, masks=[mask])
            logs = []
            train(
                backend, engine, base, night, config, tmp_path, guards=[guard] if holding else (), on_step=logs.append
            )
            lost[holding] = bare - backend.to_numpy(backend.logprobs(rows))[held].sum()
            logged[holding] = [log.anchor_hold for log in logs]
    assert lost[False] > 1.0, lost  # the night alone takes the anchor's answer away
    assert lost[True] < 0.5 * lost[False], lost
    assert logged[False] == [0.0] * 10 and logged[True][0] < 1e-5 < max(logged[True])


def test_anchor_hold_settings_are_checked(home):
    from macaron_local.daemon.config import learn_config
    from macaron_local.errors import InvalidInputError

    home.save(learn={"anchor_hold_weight": 0.5, "anchor_holds_per_step": 3})
    config = learn_config(home)
    assert (config.anchor_hold_weight, config.anchor_holds_per_step) == (0.5, 3)
    home.save(learn={"anchor_hold_weight": -1.0})
    with pytest.raises(InvalidInputError, match="anchor_hold_weight and anchor_holds_per_step must be >= 0"):
        learn_config(home)
