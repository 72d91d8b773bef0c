"""The base model's GGUF, read in the HF checkpoint layout trainers use.

Trainers name parameters the Hugging Face way (`model.layers.0.self_attn.q_proj.weight`);
llama.cpp names them the GGUF way (`blk.0.attn_q.weight`) and, for llama, stores q/k rows in
another order. gguf-py's own name map goes from one to the other, so this module only asks it.
Used to load the base into MLX (mlx-lm has no GGUF loader) and to fold a frozen expert adapter
into a trainer's base weights, whatever the backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import gguf
import numpy as np

from macaron_local.adapters.gguf_lora import field_value, read_adapter, unpermute_llama_qk_rows, update_factors
from macaron_local.adapters.peft import gguf_name, qk_permuted_heads, tensor_name_map
from macaron_local.adapters.validate import BaseModelInfo, validate_adapter
from macaron_local.errors import ModelError

#: The HF model types whose GGUF a trainer can rebuild from metadata alone.
SUPPORTED = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def name_map(base: BaseModelInfo) -> gguf.TensorNameMap:
    names = tensor_name_map(base)
    if names is None:
        raise ModelError(f"architecture {base.architecture!r} is unknown to gguf-py")
    return names


def hf_config(path: Path) -> dict:
    """An HF-style config (`model_type`, sizes, rope, norm epsilon) from the GGUF's metadata."""
    base = BaseModelInfo.from_gguf(path)
    if base.architecture not in SUPPORTED:
        raise ModelError(
            f"the {base.architecture} architecture cannot be rebuilt from its GGUF for training; "
            "name a checkpoint of the same base in the model's manifest"
        )
    reader = gguf.GGUFReader(str(path))
    arch = base.architecture

    def meta(key: str, default: object = None) -> object:
        value = field_value(reader, f"{arch}.{key}")
        return default if value is None else value

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    vocab, _ = base.tensors["token_embd.weight"]
    return {
        "model_type": SUPPORTED[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(meta("block_count")),
        "intermediate_size": int(meta("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in base.tensors,
        "attention_bias": "blk.0.attn_q.bias" in base.tensors,
    }


def load_hf_weights(path: Path, hf_parameters: Iterable[str]) -> dict[str, np.ndarray]:
    """Dequantized float32 weights for the given HF parameter names, in HF row order."""
    base = BaseModelInfo.from_gguf(path)
    names = name_map(base)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    weights = {}
    for parameter in hf_parameters:
        tensor_name = gguf_name(names, parameter)
        if tensor_name is None or tensor_name not in tensors:
            raise ModelError(f"{path.name}: the base model has no tensor for {parameter}")
        tensor = tensors[tensor_name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        values = values.reshape(tuple(int(d) for d in reversed(tensor.shape.tolist())))
        if (heads := qk_permuted_heads(base, tensor_name)) is not None:
            values = unpermute_llama_qk_rows(values, heads)
        weights[parameter] = values
    return weights


def frozen_deltas(adapter_path: Path, base: BaseModelInfo, hf_weights: Iterable[str]) -> dict[str, np.ndarray]:
    """What a (validated) adapter adds to each HF weight: scale * B @ A, in HF row order.

    A personal adapter is trained on top of its slot's expert and served stacked on it. LoRA is
    additive, so training against base + these deltas is training against the stack llama.cpp
    serves, and the base exists once in memory.
    """
    validate_adapter(adapter_path, base)
    adapter = read_adapter(adapter_path)
    names = name_map(base)
    by_tensor = {gguf_name(names, w): w for w in hf_weights}
    deltas = {}
    for tensor_name in adapter.pairs:
        parameter = by_tensor.get(tensor_name)
        if parameter is None:
            raise ModelError(f"{adapter_path.name}: the trainer has no layer for {tensor_name}")
        left, right = update_factors(adapter, tensor_name)
        delta = left @ right
        if (heads := qk_permuted_heads(base, tensor_name)) is not None:
            delta = unpermute_llama_qk_rows(delta, heads)
        deltas[parameter] = delta.astype(np.float32)
    return deltas
