"""Prove ``tinymodels`` + ``reference`` against raw llama-cpp-python.

Everything that later tests build on (adapter conversion, scales, several adapters, the llama
q/k row permutation) is only trustworthy if the numpy reference and llama.cpp agree on the
plain models first. llama.cpp runs with an F32 KV cache and flash attention off, so the only
differences left are float32 rounding (a few 1e-6); the default F16 cache would cost ~4e-3.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator, Sequence
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest
from reference import LoraDelta, reference_logits
from tinymodels import (
    TinyConfig,
    TinyModel,
    build_tiny_model,
    permute_qk,
    random_weights,
    tensor_shapes,
    unpermute_qk,
    write_tiny_model,
)

from macaron_local.engine import llama_load

TOL = 1e-4
N_CTX = 64

# Fixed prompt: every position matters (rope, causal mask), and it repeats tokens on purpose.
TOKENS = [0, 5, 17, 33, 9, 9, 41, 2, 12, 60, 7, 1, 25, 25, 50, 3]


@contextlib.contextmanager
def open_llama(path: Path) -> Iterator[llama_cpp.Llama]:
    """Open a model the way the parity tests need it: all logits, F32 KV, no flash attention."""
    llm = llama_load.open_llama(
        path,
        n_ctx=N_CTX,
        n_batch=N_CTX,
        logits_all=True,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        flash_attn=False,
        n_threads=2,
        n_threads_batch=2,
        verbose=False,
    )
    try:
        yield llm
    finally:
        llm.close()


def llama_logits(llm: llama_cpp.Llama, tokens: Sequence[int]) -> np.ndarray:
    """Logits for every position of ``tokens`` from a fresh evaluation."""
    llm.reset()
    llm.eval(list(tokens))
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)


def write_lora_gguf(path: Path, arch: str, lora: LoraDelta) -> Path:
    """Write ``lora`` as a llama.cpp LoRA adapter GGUF (F32 tensors, float32 alpha)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora.alpha))
    for name, (a, b) in lora.tensors.items():
        writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a, dtype=np.float32))
        writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@contextlib.contextmanager
def active_adapters(llm: llama_cpp.Llama, paths: Sequence[Path], scales: Sequence[float]) -> Iterator[None]:
    """Load adapters through the C API, make them the context's active set, clean up after."""
    handles = []
    try:
        for p in paths:
            handle = llama_cpp.llama_adapter_lora_init(llm.model, str(p).encode())
            # A failed load returns a NULL pointer object, which is falsy but not None.
            assert handle, f"llama.cpp refused adapter {p}"
            handles.append(handle)
        n = len(handles)
        arr = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*handles)
        c_scales = (ctypes.c_float * n)(*scales)
        assert llama_cpp.llama_set_adapters_lora(llm.ctx, arr, n, c_scales) == 0
        yield
    finally:
        llama_cpp.llama_set_adapters_lora(llm.ctx, None, 0, None)
        for handle in handles:
            llama_cpp.llama_adapter_lora_free(handle)


def random_lora(
    model: TinyModel, targets: Sequence[str], rank: int, alpha: float, seed: int, scale: float = 1.0
) -> LoraDelta:
    """A random adapter on ``blk.*.<target>.weight`` for every layer, big enough to matter."""
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(model.config)
    tensors = {}
    for i in range(model.config.n_layer):
        for t in targets:
            name = f"blk.{i}.{t}.weight"
            out_dim, in_dim = shapes[name]
            a = (rng.standard_normal((rank, in_dim)) / np.sqrt(in_dim)).astype(np.float32)
            b = (0.3 * rng.standard_normal((out_dim, rank))).astype(np.float32)
            tensors[name] = (a, b)
    return LoraDelta(tensors=tensors, alpha=alpha, scale=scale)


def max_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


BASE_CASES = {
    "llama-untied-gqa": TinyConfig(arch="llama"),
    "llama-tied": TinyConfig(arch="llama", tied_output=True),
    "qwen3-untied-gqa": TinyConfig(arch="qwen3", head_dim=16),
    "qwen3-tied": TinyConfig(arch="qwen3", head_dim=16, tied_output=True),
}


@pytest.mark.parametrize("case", list(BASE_CASES))
def test_base_model_matches_reference(tmp_path: Path, case: str) -> None:
    model = build_tiny_model(tmp_path / f"{case}.gguf", BASE_CASES[case], seed=1)
    ref = reference_logits(model, TOKENS)
    with open_llama(model.path) as llm:
        got = llama_logits(llm, TOKENS)
    assert got.shape == ref.shape == (len(TOKENS), model.config.n_vocab)
    # The model must be non-trivial: logits spread across tokens and change with position.
    assert ref.std(axis=1).min() > 0.5
    assert max_err(ref[0], ref[-1]) > 0.5
    assert max_err(got, ref) <= TOL


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lora_adapter_matches_reference(tmp_path: Path, arch: str) -> None:
    config = TinyConfig(arch=arch, head_dim=16 if arch == "qwen3" else None)
    model = build_tiny_model(tmp_path / "base.gguf", config, seed=2)
    # For llama these B rows are already in GGUF (permuted) order, so the "norm"-rope
    # reference uses them as they are.
    lora = random_lora(model, ["attn_q", "attn_v", "ffn_down"], rank=4, alpha=8.0, seed=3)
    adapter = write_lora_gguf(tmp_path / "lora.gguf", arch, lora)

    ref_base = reference_logits(model, TOKENS)
    ref = reference_logits(model, TOKENS, [lora])
    assert max_err(ref, ref_base) > 0.5, "the adapter is too weak to prove anything"
    with open_llama(model.path) as llm:
        with active_adapters(llm, [adapter], [lora.scale]):
            got = llama_logits(llm, TOKENS)
        got_after = llama_logits(llm, TOKENS)
    assert max_err(got, ref) <= TOL
    assert max_err(got_after, ref_base) <= TOL  # clearing the set really removes it


def test_two_adapters_with_scales_add_up(tmp_path: Path) -> None:
    """Several active adapters with their own user scales add up, as the reference assumes."""
    model = build_tiny_model(tmp_path / "base.gguf", TinyConfig(arch="qwen3", head_dim=16), 4)
    lora1 = random_lora(model, ["attn_k", "attn_output"], rank=2, alpha=4.0, seed=5, scale=0.7)
    lora2 = random_lora(model, ["ffn_gate", "ffn_up"], rank=8, alpha=4.0, seed=6, scale=-1.5)
    p1 = write_lora_gguf(tmp_path / "a.gguf", "qwen3", lora1)
    p2 = write_lora_gguf(tmp_path / "b.gguf", "qwen3", lora2)
    ref = reference_logits(model, TOKENS, [lora1, lora2])
    with open_llama(model.path) as llm, active_adapters(llm, [p1, p2], [0.7, -1.5]):
        got = llama_logits(llm, TOKENS)
    assert max_err(got, ref) <= TOL


def test_permute_qk_small_examples() -> None:
    rows = np.arange(8)
    assert permute_qk(rows, 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert permute_qk(rows, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    w = np.random.default_rng(0).standard_normal((12, 5))
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)


def test_hf_convention_neox_rope_matches_permuted_gguf(tmp_path: Path) -> None:
    """HF llama weights with neox rope == permuted GGUF weights in llama.cpp (norm rope).

    Also covers an HF-convention LoRA on q/k: its B rows need the same permutation.
    """
    config = TinyConfig(arch="llama")
    hf = random_weights(config, seed=7)
    gguf_weights = dict(hf)
    for i in range(config.n_layer):
        q, k = f"blk.{i}.attn_q.weight", f"blk.{i}.attn_k.weight"
        gguf_weights[q] = permute_qk(hf[q], config.n_head)
        gguf_weights[k] = permute_qk(hf[k], config.n_head_kv)
    written = write_tiny_model(tmp_path / "hf.gguf", config, gguf_weights)
    hf_model = TinyModel(path=written.path, config=config, weights=hf)

    hf_lora = random_lora(hf_model, ["attn_q", "attn_k"], rank=4, alpha=8.0, seed=8)
    gguf_tensors = {}
    for name, (a, b) in hf_lora.tensors.items():
        n = config.n_head if ".attn_q." in name else config.n_head_kv
        gguf_tensors[name] = (a, permute_qk(b, n))
    adapter = write_lora_gguf(tmp_path / "hf-lora.gguf", "llama", LoraDelta(gguf_tensors, alpha=hf_lora.alpha))

    ref = reference_logits(hf_model, TOKENS, rope_style="neox")
    ref_lora = reference_logits(hf_model, TOKENS, [hf_lora], rope_style="neox")
    with open_llama(written.path) as llm:
        got = llama_logits(llm, TOKENS)
        with active_adapters(llm, [adapter], [1.0]):
            got_lora = llama_logits(llm, TOKENS)
    assert max_err(got, ref) <= TOL
    assert max_err(got_lora, ref_lora) <= TOL
    # The test can tell the conventions apart: the wrong rope on HF weights is far off, and
    # the permuted GGUF weights agree with the default (norm) reference.
    assert max_err(got, reference_logits(hf_model, TOKENS)) > 0.1
    assert max_err(got, reference_logits(written, TOKENS)) <= TOL
