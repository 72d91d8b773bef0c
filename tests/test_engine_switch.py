"""Switching adapter sets never serves keys/values computed under another set.

llama.cpp leaves the KV cache alone when adapters change, and llama-cpp-python reuses the
longest common token prefix. These tests run A -> B -> A inside one conversation and compare
with fresh engines; one test shows that skipping the KV handling really gives wrong logits,
so the others would catch an engine that skipped it.
"""

from __future__ import annotations

import threading

import llama_cpp
import numpy as np
import pytest
from conftest import write_random_adapter

from macaron_local.engine import Engine, EngineConfig, GenerationParams

PROMPT = [0, 5, 17, 33, 9, 9, 41, 2, 12, 60, 7, 1]
LONGER = [*PROMPT, 25, 25, 50, 3]
GREEDY = GenerationParams(max_tokens=12, temperature=0.0, min_p=0.0)


def open_engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model_path=path, n_ctx=128, n_batch=64, kv_f32=True, n_threads=2, **kw))


@pytest.fixture
def two_adapters(tiny_model, tmp_path):
    model = tiny_model("qwen3", False)
    a = write_random_adapter(tmp_path / "a.gguf", model, rank=8, seed=11, magnitude=1.5)
    b = write_random_adapter(tmp_path / "b.gguf", model, rank=8, seed=12, magnitude=1.5)
    return model, a, b


def fresh_logits(model, adapter, tokens):
    with open_engine(model.path) as engine:
        if adapter is not None:
            engine.set_adapters([engine.load_adapter(adapter)])
        return engine.logits(tokens)


def fresh_greedy(model, adapter, tokens):
    with open_engine(model.path) as engine:
        if adapter is not None:
            engine.set_adapters([engine.load_adapter(adapter)])
        return engine.generate(tokens, GREEDY).tokens


@pytest.mark.parametrize("policy", ["reset", "state"])
def test_a_b_a_logits_equal_fresh_runs(two_adapters, policy):
    model, a, b = two_adapters
    with open_engine(model.path, kv_switch=policy) as engine:
        ha, hb = engine.load_adapter(a), engine.load_adapter(b)
        engine.set_adapters([ha])
        first = engine.logits(PROMPT)
        engine.set_adapters([hb])
        middle = engine.logits(LONGER)  # shares PROMPT as a prefix: the trap
        engine.set_adapters([ha])
        last = engine.logits(LONGER)
    np.testing.assert_allclose(first, fresh_logits(model, a, PROMPT), atol=1e-5)
    np.testing.assert_allclose(middle, fresh_logits(model, b, LONGER), atol=1e-5)
    np.testing.assert_allclose(last, fresh_logits(model, a, LONGER), atol=1e-5)


@pytest.mark.parametrize("policy", ["reset", "state"])
def test_a_b_a_generation_equals_fresh_runs(two_adapters, policy):
    model, a, b = two_adapters
    with open_engine(model.path, kv_switch=policy) as engine:
        ha, hb = engine.load_adapter(a), engine.load_adapter(b)
        engine.set_adapters([ha])
        first = engine.generate(PROMPT, GREEDY).tokens
        engine.set_adapters([hb])
        middle = engine.generate(PROMPT, GREEDY)
        engine.set_adapters([ha])
        last = engine.generate(PROMPT + first[:3], GREEDY)
        engine.set_adapters([])
        base = engine.generate(PROMPT, GREEDY).tokens
    assert middle.tokens == fresh_greedy(model, b, PROMPT)
    assert last.tokens == fresh_greedy(model, a, PROMPT + first[:3])
    assert base == fresh_greedy(model, None, PROMPT)
    assert first != middle.tokens, "the two adapters must behave differently for this test to mean anything"
    if policy == "reset":
        assert middle.reused_prompt_tokens == 0
    else:  # the state saved under A was restored: its prompt prefix is reused legitimately
        assert last.reused_prompt_tokens >= len(PROMPT)


def test_skipping_kv_handling_gives_wrong_logits(two_adapters):
    """What the engine guards against: switch adapters behind its back and reuse the prefix."""
    model, a, b = two_adapters
    with open_engine(model.path) as engine:
        ha, hb = engine.load_adapter(a), engine.load_adapter(b)
        engine.set_adapters([ha])
        engine.logits(PROMPT)
        pointers = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(hb.pointer)
        scales = (llama_cpp.ctypes.c_float * 1)(1.0)
        llama_cpp.llama_set_adapters_lora(engine.llm.ctx, pointers, 1, scales)
        stale = engine.token_logprobs(PROMPT, LONGER[len(PROMPT) :])  # reuses the cached prefix
        engine.set_adapters([hb])  # the engine's own switch: resets the cache
        engine.set_adapters([ha])
        engine.logits(PROMPT)
        engine.set_adapters([hb])
        honest = engine.token_logprobs(PROMPT, LONGER[len(PROMPT) :])
    with open_engine(model.path) as engine:
        engine.set_adapters([engine.load_adapter(b)])
        fresh = engine.token_logprobs(PROMPT, LONGER[len(PROMPT) :])
    assert np.abs(stale - fresh).max() > 0.1
    np.testing.assert_allclose(honest, fresh, atol=1e-5)


def test_unchanged_set_keeps_prefix_cache(two_adapters):
    model, a, _ = two_adapters
    with open_engine(model.path) as engine:
        ha = engine.load_adapter(a)
        engine.set_adapters([ha])
        first = engine.generate(PROMPT, GREEDY)
        assert engine.set_adapters([ha]) is False
        follow = engine.generate(PROMPT + first.tokens + [3, 4], GREEDY)
    assert follow.reused_prompt_tokens >= len(PROMPT) + len(first.tokens) - 1


def test_same_file_loads_once(two_adapters, tmp_path):
    model, a, _ = two_adapters
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(a.read_bytes())
    with open_engine(model.path) as engine:
        assert engine.load_adapter(a) is engine.load_adapter(copy)


def test_closing_the_engine_stops_a_reply_being_written_on_another_thread(tiny_model):
    """A front end that closes while a reply streams (the chat app quitting, a server stopping)
    must not wait for the whole reply: the stream stops at its next token and close() returns."""
    model = tiny_model("llama", False)
    engine = open_engine(model.path)
    generation = engine.stream(PROMPT, GenerationParams(max_tokens=50, temperature=0.0, min_p=0.0))
    closer = threading.Thread(target=engine.close)
    for i, _ in enumerate(generation):
        if i == 2:
            closer.start()
            closer.join(0.2)
            assert closer.is_alive()  # the stream holds the engine until its next token
    closer.join(10)
    assert not closer.is_alive() and engine.llm is None
    assert generation.result.finish_reason in ("cancelled", "stop") and len(generation.result.tokens) <= 4


def test_cancel_stops_generation(tiny_model):
    model = tiny_model("llama", False)
    cancel = threading.Event()
    with open_engine(model.path) as engine:
        generation = engine.stream(PROMPT, GenerationParams(max_tokens=50, temperature=0.0, min_p=0.0), cancel)
        for i, _ in enumerate(generation):
            if i == 2:
                cancel.set()
        assert generation.result.finish_reason in ("cancelled", "stop")
        assert len(generation.result.tokens) <= 4
        # The engine is usable straight after a cancel.
        assert engine.generate(PROMPT, GenerationParams(max_tokens=3, temperature=0.0, min_p=0.0)).tokens
