"""The regression set and its scoring: passage NLL without the chat template, factual QA by key terms."""

from __future__ import annotations

import numpy as np
from conftest import EMBEDDED_GGUF, write_random_adapter

from macaron_local.engine import Engine, EngineConfig
from macaron_local.learn.regression import answer_is_right, load_regression_set, passage_nll, score


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
    model = tiny_model("llama", False)
    with Engine(EngineConfig(model_path=model.path, n_ctx=128, kv_f32=True)) as engine:
        texts = ["abc abc", "hello world"]
        plain = passage_nll(engine, texts)
        engine.set_adapters([engine.load_adapter(write_random_adapter(tmp_path / "a.gguf", model, rank=4, seed=9))])
        assert not np.isclose(passage_nll(engine, texts), plain)
