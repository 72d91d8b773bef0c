"""The engine computes exactly base + the adapters we wrote: llama.cpp's logits through the
engine against an independent float64 numpy forward pass.

Tolerances, per adapter storage type (F32 KV cache, flash attention off; the reference uses the
adapter values as stored in the file, so storage rounding itself is not an error):
- F32: 1e-4 (measured: 2e-6 to 4e-6). Only float32 rounding differs.
- F16, BF16, Q8_0: ggml multiplies a weight of these types by activations converted to the
  same type (its `vec_dot_type`), so the LoRA path also rounds its inputs. Measured with rank-8
  adapters that move logits by several units: F16 up to 1e-2, BF16 up to 7e-2, Q8_0 (rank 32)
  up to 0.15. The bounds below are about 3x those, and each test first checks that the adapters
  move the logits by far more than its bound, so a wrong or missing adapter still fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import as_delta, random_adapter, write_random_adapter
from reference import LoraDelta, reference_logits

from macaron_local.adapters import write_adapter
from macaron_local.engine import Engine, EngineConfig

TOL = {"F32": 1e-4, "F16": 3e-2, "BF16": 0.2, "Q8_0": 0.45}
TOKENS = [0, 5, 17, 33, 9, 9, 41, 2, 12, 60, 7, 1, 25, 25, 50, 3]


def open_engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model_path=path, n_ctx=64, n_batch=64, kv_f32=True, n_threads=2, **kw))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_base_logits_match_reference(tiny_model, arch, tied):
    model = tiny_model(arch, tied)
    assert model.config.n_head_kv < model.config.n_head  # grouped-query attention
    with open_engine(model.path) as engine:
        got = engine.logits(TOKENS)
    want = reference_logits(model, TOKENS)
    assert np.abs(got - want).max() <= TOL["F32"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtypes", [("F32", "F32"), ("F16", "F32"), ("F16", "F16")], ids=lambda d: "+".join(d))
def test_two_adapters_rank_1_and_8_match_reference(tiny_model, tmp_path, arch, tied, dtypes):
    model = tiny_model(arch, tied)
    first = write_random_adapter(tmp_path / "r1.gguf", model, rank=1, seed=1, dtype=dtypes[0])
    second = write_random_adapter(tmp_path / "r8.gguf", model, rank=8, seed=2, dtype=dtypes[1])
    with open_engine(model.path) as engine:
        engine.set_adapters([(engine.load_adapter(first), 1.0), (engine.load_adapter(second), 0.5)])
        got = engine.logits(TOKENS)
    want = reference_logits(model, TOKENS, [as_delta(first), as_delta(second, 0.5)])
    tol = max(TOL[d] for d in dtypes)
    effect = np.abs(want - reference_logits(model, TOKENS)).max()
    assert effect > 10 * tol, "the adapters must move the logits far more than the tolerance"
    assert np.abs(got - want).max() <= tol


@pytest.mark.parametrize("dtype", ["BF16", "Q8_0"])
def test_bf16_and_q8_0_adapters_match_reference(tiny_model, tmp_path, dtype):
    model = tiny_model("qwen3", False)
    path = write_random_adapter(tmp_path / f"{dtype}.gguf", model, rank=32, seed=3, dtype=dtype)
    with open_engine(model.path) as engine:
        engine.set_adapters([engine.load_adapter(path)])
        got = engine.logits(TOKENS)
    want = reference_logits(model, TOKENS, [as_delta(path)])
    assert np.abs(want - reference_logits(model, TOKENS)).max() > 5 * TOL[dtype]
    assert np.abs(got - want).max() <= TOL[dtype]


def test_f16_storage_stays_close_to_float32_values(tiny_model, tmp_path):
    model = tiny_model("llama", False)
    adapter = random_adapter(model, rank=8, seed=4)
    path = write_adapter(tmp_path / "f16.gguf", adapter, dtype="F16")
    exact = LoraDelta({n: (p.a, p.b) for n, p in adapter.pairs.items()}, alpha=adapter.alpha)
    with open_engine(model.path) as engine:
        engine.set_adapters([engine.load_adapter(path)])
        got = engine.logits(TOKENS)
    assert np.abs(got - reference_logits(model, TOKENS, [exact])).max() <= TOL["F16"]


def test_token_logprobs_are_log_softmax_of_reference(tiny_model, tmp_path):
    model = tiny_model("qwen3", False)
    path = write_random_adapter(tmp_path / "a.gguf", model, rank=4, seed=5)
    prompt, completion = TOKENS[:10], TOKENS[10:]
    with open_engine(model.path) as engine:
        engine.set_adapters([engine.load_adapter(path)])
        got = engine.token_logprobs(prompt, completion)
        again = engine.token_logprobs(prompt, completion)  # served from the reused prefix
    logits = reference_logits(model, TOKENS, [as_delta(path)])
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        - logits.max(1, keepdims=True)
    )
    want = np.array([logp[len(prompt) - 1 + i, tok] for i, tok in enumerate(completion)])
    assert np.abs(got - want).max() <= TOL["F32"]
    assert np.array_equal(got, again)
