"""PEFT LoRA directories convert to GGUF adapters that llama.cpp applies exactly as PEFT would.

The reference runs in the Hugging Face convention (unpermuted llama q/k rows, half-split rope),
so the test proves the converter's q/k row permutation, name mapping and scaling end to end.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from conftest import run_cli
from reference import LoraDelta, reference_logits
from safetensors.numpy import save_file
from tinymodels import TinyConfig, TinyModel, permute_qk, random_weights, write_tiny_model

from macaron_local.adapters import BaseModelInfo, read_adapter
from macaron_local.adapters.peft import convert_peft_dir
from macaron_local.engine import Engine, EngineConfig
from macaron_local.errors import AdapterError

TOKENS = [0, 5, 17, 33, 9, 9, 41, 2, 12, 60, 7, 1, 25, 25, 50, 3]
HF_MODULES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def hf_model(tmp_path, arch: str) -> tuple[TinyModel, TinyModel]:
    """(GGUF model as llama.cpp runs it, the same model in HF convention for the reference)."""
    config = TinyConfig(arch=arch)
    hf = random_weights(config, seed=21)
    gguf_weights = dict(hf)
    if arch == "llama":
        for i in range(config.n_layer):
            gguf_weights[f"blk.{i}.attn_q.weight"] = permute_qk(hf[f"blk.{i}.attn_q.weight"], config.n_head)
            gguf_weights[f"blk.{i}.attn_k.weight"] = permute_qk(hf[f"blk.{i}.attn_k.weight"], config.n_head_kv)
    model = write_tiny_model(tmp_path / f"{arch}.gguf", config, gguf_weights)
    return model, TinyModel(model.path, config, hf)


def peft_dir(tmp_path, model: TinyModel, rank: int, alpha: float, **config_extra) -> tuple[object, dict]:
    """Write a PEFT adapter directory; returns (dir, {gguf name: (A, B) in HF row order})."""
    rng = np.random.default_rng(22)
    tensors, pairs = {}, {}
    for i in range(model.config.n_layer):
        for module, role in HF_MODULES.items():
            out, inp = model.weights[f"blk.{i}.{role}.weight"].shape
            a = rng.normal(0, 1 / np.sqrt(inp), (rank, inp)).astype(np.float32)
            b = rng.normal(0, 0.8 / np.sqrt(rank), (out, rank)).astype(np.float32)
            prefix = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            pairs[f"blk.{i}.{role}.weight"] = (a, b)
    out, inp = model.weights["output.weight"].shape
    a, b = (
        rng.normal(0, 0.2, (rank, inp)).astype(np.float32),
        rng.normal(0, 0.2, (out, rank)).astype(np.float32),
    )
    tensors["base_model.model.lm_head.lora_A.weight"], tensors["base_model.model.lm_head.lora_B.weight"] = (
        a,
        b,
    )
    pairs["output.weight"] = (a, b)
    directory = tmp_path / "peft"
    directory.mkdir()
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": "all-linear",
        **config_extra,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory, pairs


def engine_logits(model: TinyModel, adapter) -> np.ndarray:
    with Engine(EngineConfig(model_path=model.path, n_ctx=64, kv_f32=True, n_threads=2)) as engine:
        engine.set_adapters([engine.load_adapter(adapter)])
        return engine.logits(TOKENS)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_converted_peft_adapter_matches_hf_convention_reference(tmp_path, arch):
    model, hf_view = hf_model(tmp_path, arch)
    directory, pairs = peft_dir(tmp_path, hf_view, rank=8, alpha=16)
    out = convert_peft_dir(directory, BaseModelInfo.from_gguf(model.path), tmp_path / "a.gguf", dtype="F32")
    got = engine_logits(model, out)
    want = reference_logits(hf_view, TOKENS, [LoraDelta(pairs, alpha=16)], rope_style="neox")
    assert np.abs(want - reference_logits(hf_view, TOKENS, rope_style="neox")).max() > 1.0
    assert np.abs(got - want).max() <= 1e-4


def test_llama_q_rows_are_permuted_and_qwen3_rows_are_not(tmp_path):
    for arch, permuted in (("llama", True), ("qwen3", False)):
        workdir = tmp_path / arch
        workdir.mkdir()
        model, hf_view = hf_model(workdir, arch)
        directory, pairs = peft_dir(workdir, hf_view, rank=4, alpha=4)
        out = convert_peft_dir(directory, BaseModelInfo.from_gguf(model.path), workdir / "a.gguf", dtype="F32")
        stored = read_adapter(out).pairs["blk.0.attn_q.weight"].b
        hf_b = pairs["blk.0.attn_q.weight"][1]
        expected = permute_qk(hf_b, model.config.n_head) if permuted else hf_b
        np.testing.assert_array_equal(stored, expected)


def test_rslora_and_alpha_pattern_scaling_is_folded_into_b(tmp_path):
    model, hf_view = hf_model(tmp_path, "qwen3")
    directory, pairs = peft_dir(
        tmp_path, hf_view, rank=4, alpha=8, use_rslora=True, alpha_pattern={"mlp.down_proj": 2.0}
    )
    out = convert_peft_dir(directory, BaseModelInfo.from_gguf(model.path), tmp_path / "a.gguf", dtype="F32")
    deltas = []
    for name, (a, b) in pairs.items():
        alpha = 2.0 if "ffn_down" in name else 8.0
        scale = alpha / np.sqrt(4)  # rsLoRA: alpha / sqrt(r)
        deltas.append(LoraDelta({name: (a, b * scale)}, alpha=0.0))  # alpha 0: delta = scale * B A
    want = reference_logits(hf_view, TOKENS, deltas)
    assert np.abs(engine_logits(model, out) - want).max() <= 1e-4


def test_bf16_safetensors_are_read(tmp_path):
    model, hf_view = hf_model(tmp_path, "qwen3")
    directory, pairs = peft_dir(tmp_path, hf_view, rank=4, alpha=8)
    weights = directory / "adapter_model.safetensors"
    from safetensors.numpy import load_file

    loaded = load_file(str(weights))
    header, blobs, offset = {}, [], 0
    for key, value in loaded.items():
        bits = (value.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[key] = {
            "dtype": "BF16",
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(bits)],
        }
        blobs.append(bits)
        offset += len(bits)
    head = json.dumps(header).encode()
    weights.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    out = convert_peft_dir(directory, BaseModelInfo.from_gguf(model.path), tmp_path / "a.gguf", dtype="F32")
    truncated = {n: (_bf16(a), _bf16(b)) for n, (a, b) in pairs.items()}
    want = reference_logits(hf_view, TOKENS, [LoraDelta(truncated, alpha=8)])
    assert np.abs(engine_logits(model, out) - want).max() <= 1e-4


def _bf16(x: np.ndarray) -> np.ndarray:
    return ((x.astype(np.float32).view(np.uint32) >> 16) << 16).astype(np.uint32).view(np.float32)


def test_bad_peft_dirs_are_refused_with_one_line(tmp_path):
    model, hf_view = hf_model(tmp_path, "qwen3")
    base = BaseModelInfo.from_gguf(model.path)
    with pytest.raises(AdapterError, match="needs adapter_config.json"):
        convert_peft_dir(tmp_path, base, tmp_path / "x.gguf")
    directory, _ = peft_dir(tmp_path, hf_view, rank=4, alpha=8)
    (directory / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="unreadable PEFT adapter"):
        convert_peft_dir(directory, base, tmp_path / "x.gguf")
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    save_file(
        {
            "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": np.zeros((4, 32), np.float32),
            "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": np.zeros((32, 4), np.float32),
        },
        str(directory / "adapter_model.safetensors"),
    )
    with pytest.raises(AdapterError, match="has no tensor"):
        convert_peft_dir(directory, base, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_cli_convert_then_validate(tmp_path):
    model, hf_view = hf_model(tmp_path, "llama")
    directory, _ = peft_dir(tmp_path, hf_view, rank=4, alpha=8)
    home = tmp_path / "home"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, home=home)

    assert run("models", "add", "tiny", str(model.path)).returncode == 0
    converted = run("adapters", "convert", str(directory), str(tmp_path / "out.gguf"), "--model", "tiny")
    assert converted.returncode == 0, converted.stderr
    checked = run("adapters", "validate", str(tmp_path / "out.gguf"), "--model", "tiny", "--json")
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["pairs"] == 2 * 7 + 1
