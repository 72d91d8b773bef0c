"""Experts beyond the RAM budget are freed and loaded again when routed to (tiny qwen3_5_moe).

Where four Tall experts do not fit next to the base, the engine keeps as many as fit
(EngineConfig.max_adapter_bytes) and reloads the routed one on demand; the answers must be the
same as with everything resident.
"""

from __future__ import annotations

import copy

import numpy as np
import tiny_qwen35moe as tq

from macaron_local.adapters import BaseModelInfo
from macaron_local.adapters.peft import convert_peft_dir
from macaron_local.engine import Engine, EngineConfig

TOKENS = [0, 5, 17, 33, 9, 9, 41, 2, 12]


def test_qwen3_5_moe_experts_load_on_demand_within_the_budget(tmp_path):
    tiny = tq.build(tmp_path, seed=0)
    base = BaseModelInfo.from_gguf(tiny.gguf_path)
    paths = []
    for seed in (1, 2):
        model = tq.add_random_lora(copy.deepcopy(tiny.model), 32, seed, groups=("attention",), experts=True)
        model.save_pretrained(tmp_path / f"peft{seed}")
        paths.append(convert_peft_dir(tmp_path / f"peft{seed}", base, tmp_path / f"e{seed}.gguf", dtype="Q8_0"))
    config = dict(model_path=tiny.gguf_path, n_ctx=64, kv_f32=True, n_threads=2)
    with Engine(EngineConfig(**config)) as engine:
        want = []
        for path in paths:
            engine.set_adapters([engine.load_adapter(path)])
            want.append(engine.logits(TOKENS))
    assert np.abs(want[0] - want[1]).max() > 0.1

    budget = int(1.5 * max(p.stat().st_size for p in paths))  # room for one expert at a time
    with Engine(EngineConfig(**config, max_adapter_bytes=budget)) as engine:
        handles = [engine.load_adapter(p) for p in paths]
        assert len(engine.loaded) == 1  # loading the second freed the first
        for round_ in range(2):
            for handle, expected in zip(handles, want, strict=True):
                engine.set_adapters([handle])
                assert engine.loaded == (handle.path,)
                assert np.abs(engine.logits(TOKENS) - expected).max() <= 1e-4, round_
        assert engine.reload_count == 4
