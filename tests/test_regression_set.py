"""The regression set and its scoring: passage NLL without the chat template, factual QA by key terms."""

from __future__ import annotations

import numpy as np
from conftest import EMBEDDED_GGUF, write_random_adapter

from macaron_local.engine import Engine, EngineConfig
from macaron_local.learn import gate
from macaron_local.learn.regression import (
    Answer,
    RegressionScore,
    answer_is_right,
    load_regression_set,
    lost_answers,
    passage_nll,
    score,
)


def test_the_set_ships_with_the_package():
    data = load_regression_set()
    assert len(data["passages"]) >= 8 and len(data["questions"]) >= 12
    assert all(q["answer_terms"] for q in data["questions"])


def test_answers_are_judged_by_key_terms_case_insensitively():
    assert answer_is_right("The capital is PARIS.", ["paris"])
    assert answer_is_right("It has 8 legs", ["eight", "8"])
    assert not answer_is_right("Lyon", ["paris"])


def test_embedded_model_scores_and_an_adapter_changes_the_nll(tiny_model, tmp_path):
    with Engine(EngineConfig(model_path=EMBEDDED_GGUF, n_ctx=512)) as engine:
        result = score(engine, [])
        assert 1.0 < result.passage_nll < 6.0  # nats per token of plain English
        assert result.qa_right >= 6 and result.qa_total == 12  # the base model knows most of these
        questions = [q["question"] for q in load_regression_set()["questions"]]
        assert [a.question for a in result.answers] == questions
        assert sum(a.right for a in result.answers) == result.qa_right and all(a.reply for a in result.answers)
    model = tiny_model("llama", False)
    with Engine(EngineConfig(model_path=model.path, n_ctx=128, kv_f32=True)) as engine:
        texts = ["abc abc", "hello world"]
        plain = passage_nll(engine, texts)
        engine.set_adapters([engine.load_adapter(write_random_adapter(tmp_path / "a.gguf", model, rank=4, seed=9))])
        assert not np.isclose(passage_nll(engine, texts), plain)


def test_a_rejection_for_lost_answers_names_the_questions_and_what_replaced_them():
    def scored(*rights: tuple[str, str, bool]) -> RegressionScore:
        answers = tuple(Answer(q, reply, right) for q, reply, right in rights)
        return RegressionScore(2.0, sum(a.right for a in answers), len(answers), answers)

    bare = scored(("Capital of France?", "Paris.", True), ("Legs?", "Eight.", True), ("Gas?", "Nitrogen.", False))
    long_reply = "  - Lena is your sister. " + "x" * 200
    after = scored(("Capital of France?", long_reply, False), ("Legs?", "Eight.", True), ("Gas?", "Argon.", False))
    lost = lost_answers(after, bare)
    # only what the bare experts knew counts as lost, and the reply is trimmed to what replaced it
    assert lost == [{"question": "Capital of France?", "reply": long_reply.strip()[:80]}]
    assert lost_answers(bare, bare) == []
    held = gate.Scores([0.5, 0.5], [], after)
    reasons, figures = gate.verdict(held, gate.Scores([0.0, 0.0], [], bare), bare)
    assert figures["regression_lost"] == lost and any("factual answers dropped" in r for r in reasons)
    _, kept = gate.verdict(gate.Scores([0.5, 0.5], [], bare), gate.Scores([0.0, 0.0], [], bare), bare)
    assert "regression_lost" not in kept
