"""MLX side of Tall: load a `qwen3_5_moe` checkpoint through mlx-lm (4-bit where asked) and keep
the slot's expert as frozen LoRA layers under the personal ones.

mlx-lm's qwen3_5 keeps the Hugging Face layout (no Gated DeltaNet head reorder, packed
`experts.gate_up_proj` split into `switch_mlp.gate_proj` / `up_proj`), so a PEFT expert's
factors apply as they are: A^T / B^T for a plain linear layer (mlx-lm's LoRALinear keeps
(in, r) and (r, out)), and PEFT's packed expert factors unpacked to (E, r, in) / (E, out, r),
which is LoRASwitchLinear's own layout. Each expert layer is a LoRA wrapped around the base
layer; a personal LoRA already around that base layer wraps the expert one instead, so its
output is base + expert + personal, summed as llama.cpp sums the two adapters.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from macaron_local.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, SafetensorsFile, _module_scale
from macaron_local.errors import ModelError

#: HF text-model types mlx-lm knows under another name.
MLX_MODEL_TYPES = {"qwen3_5_moe_text": "qwen3_5_moe"}
#: Where mlx-lm's qwen3_5 puts the text tower's layers (HF `model.layers.N...`).
MLX_PREFIX = "language_model.model."


def load_checkpoint(directory: Path, bits: int | None = None, group_size: int = 64):
    """mlx-lm's model for an HF checkpoint directory, optionally quantized (affine, `bits`)."""
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes, load_model

    config = json.loads((Path(directory) / "config.json").read_text())
    text = config.get("text_config", config)
    overrides: dict = {}
    if config.get("model_type") in MLX_MODEL_TYPES:
        overrides["model_type"] = MLX_MODEL_TYPES[config["model_type"]]
    if "layer_types" in text and "full_attention_interval" not in text:  # mlx-lm reads only the interval
        overrides["full_attention_interval"] = _full_attention_interval(text["layer_types"])

    def classes(config: dict):
        model_class, args_class = _get_classes(config)

        class PerExpertCheckpoint(model_class):
            """Also loads checkpoints that store each routed expert apart (`experts.N.gate_proj`),
            as transformers writes them and as Qwen publishes them."""

            def sanitize(self, weights):
                return super().sanitize(stack_experts(weights))

        return PerExpertCheckpoint, args_class

    try:
        model, config = load_model(Path(directory), model_config=overrides, get_model_classes=classes)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelError(f"mlx-lm cannot load the trainer checkpoint {directory}: {str(exc)[:300]}") from None
    if bits:
        predicate = getattr(model, "quant_predicate", None)

        def which(path, module):
            if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
                return False
            return predicate(path, module) if predicate else True

        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=which)
    return model, config


def _full_attention_interval(layer_types: list[str]) -> int:
    interval = layer_types.index("full_attention") + 1
    if any((t == "full_attention") != ((i + 1) % interval == 0) for i, t in enumerate(layer_types)):
        raise ModelError("mlx-lm needs full-attention layers at a fixed interval")
    return interval


def stack_experts(weights: dict) -> dict:
    """`...mlp.experts.N.{gate,up,down}_proj.weight` -> the packed `experts.gate_up_proj` /
    `experts.down_proj` mlx-lm's qwen3_5_moe sanitizer expects."""
    import re

    import mlx.core as mx

    pattern = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    grouped: dict[str, dict[str, dict[int, object]]] = {}
    out = {}
    for key, value in weights.items():
        match = pattern.match(key)
        if match is None:
            out[key] = value
            continue
        prefix, index, proj = match.groups()
        grouped.setdefault(prefix, {}).setdefault(proj, {})[int(index)] = value
    for prefix, projs in grouped.items():
        n = len(projs["down"])
        gate = mx.stack([projs["gate"][e] for e in range(n)])
        up = mx.stack([projs["up"][e] for e in range(n)])
        out[f"{prefix}.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
        out[f"{prefix}.down_proj"] = mx.stack([projs["down"][e] for e in range(n)])
    return out


def text_model(model):
    """The module with `.model` (decoder) and `.lm_head`: mlx-lm wraps qwen3_5 in `language_model`."""
    return getattr(model, "language_model", model)


def _module_path(peft_key: str) -> str:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> mlx-lm's module path."""
    module = peft_key.split(".lora_")[0].removeprefix("base_model.model.")
    module = module.replace("model.language_model.", "model.")
    return MLX_PREFIX + module.removeprefix("model.")


def expert_factors(peft_dir: Path, n_experts: int, hidden: int) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """mlx-lm module path -> (lora_a, lora_b, scale) in mlx-lm's orientation, for every pair."""
    peft_dir = Path(peft_dir)
    if not (peft_dir / CONFIG_FILE).is_file() or not (peft_dir / WEIGHTS_FILE).is_file():
        raise ModelError(f"{peft_dir} is not a PEFT adapter directory")
    config = json.loads((peft_dir / CONFIG_FILE).read_text())
    weights = SafetensorsFile(peft_dir / WEIGHTS_FILE)
    out: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}
    for key in weights.names():
        if ".lora_A." not in key:
            continue
        a = weights.read(key).astype(np.float32)
        b = weights.read(key.replace(".lora_A.", ".lora_B.")).astype(np.float32)
        module = _module_path(key)
        if ".mlp.experts" in module:  # PEFT's packed 3-D experts: (E r, in) and (out, r E)
            rank = a.shape[0] // n_experts
            scale = _module_scale(config, key.split(".lora_")[0], rank)
            a3 = a.reshape(n_experts, rank, -1)
            b3 = b.reshape(b.shape[0], rank, n_experts).transpose(2, 0, 1)
            layer = module.split(".mlp.experts")[0] + ".mlp.switch_mlp."
            if a3.shape[-1] == hidden:  # gate_up (reads the hidden state): gate rows first, then up
                half = b3.shape[1] // 2
                out[layer + "gate_proj"] = (a3, np.ascontiguousarray(b3[:, :half]), scale)
                out[layer + "up_proj"] = (a3, np.ascontiguousarray(b3[:, half:]), scale)
            else:
                out[layer + "down_proj"] = (a3, np.ascontiguousarray(b3), scale)
            continue
        rank = a.shape[0]
        out[module] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T), _module_scale(config, module, rank))
    return out
