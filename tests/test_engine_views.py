"""The engine's KV states per (adapter set, view): one expert's view survives other prompts
under the same adapters, one-off prompts are not kept, and the cache stays bounded."""

from __future__ import annotations

import numpy as np
from conftest import write_random_adapter

from macaron_local.engine import Engine, EngineConfig, GenerationParams

GREEDY = GenerationParams(max_tokens=4, temperature=0.0, min_p=0.0)
VIEW = [0, 5, 17, 33, 9, 9, 41, 2, 12, 60, 7, 1, 20, 21, 22, 23]
OTHER = [0, 40, 41, 42, 43, 44, 45]


def open_engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model_path=path, n_ctx=128, n_batch=64, kv_f32=True, n_threads=2, **kw))


def test_a_view_is_restored_after_another_view_under_the_same_adapters(tiny_model, tmp_path):
    model = tiny_model("qwen3", False)
    with open_engine(model.path) as engine:
        adapter = engine.load_adapter(write_random_adapter(tmp_path / "a.gguf", model, rank=4, seed=3))
        engine.set_adapters([adapter], view="L0")
        first = engine.generate(VIEW, GREEDY)
        engine.set_adapters([adapter], view="route", remember=False)  # same adapters, another prompt
        engine.generate(OTHER, GREEDY)
        assert engine.set_adapters([adapter], view="L0")  # the route prompt is dropped, L0 restored
        extended = [*VIEW, *first.tokens, 30, 31]
        again = engine.generate(extended, GREEDY)
        assert again.reused_prompt_tokens >= len(VIEW)  # only the appended tail is prefilled
        assert [key for key, _, _ in engine.saved_states] == []  # restored states leave the cache
        assert not engine.set_adapters([adapter], view="L0")  # nothing changes: nothing to do
    with open_engine(model.path) as fresh:  # and the restored KV computes what a fresh run does
        fresh.set_adapters([fresh.load_adapter(tmp_path / "a.gguf")])
        assert fresh.generate(extended, GREEDY).tokens == again.tokens


def test_saved_states_are_bounded_by_count_and_bytes(tiny_model):
    model = tiny_model("qwen3", False)
    with open_engine(model.path, max_saved_states=3) as engine:
        for view in "abcde":
            engine.set_adapters([], view=view)
            engine.generate(VIEW, GREEDY)
        engine.set_adapters([], view="z")
        assert [key[1] for key, _, _ in engine.saved_states] == ["c", "d", "e"]  # oldest dropped
        one = engine.saved_states[0][2]
    with open_engine(model.path, max_saved_state_bytes=int(one * 1.5)) as engine:
        for view in "abc":
            engine.set_adapters([], view=view)
            engine.generate(VIEW, GREEDY)
        engine.set_adapters([], view="z")
        assert [key[1] for key, _, _ in engine.saved_states] == ["c"]
        assert np.sum([size for _, _, size in engine.saved_states]) <= one * 1.5
