"""Nights that build on each other: start tonight's LoRA from the deployed personal version.

The deployed GGUF adapter is read back into the trainer's LoRA factors (the inverse of the
PEFT -> GGUF export: the same gguf-py name map, llama's q/k rows un-permuted), so a night
continues what the user already has instead of relearning it from zero on a sample of old
episodes. The KL term then holds the night to where it started (`LearnConfig.kl_reference`,
"deployed" by default): held to the base instead, every night pulled what earlier nights taught
back toward the base, and replay had to win it back. The gate still compares with the base, a
stable reference. An adapter of the same scale (alpha / rank) and no higher rank is continued:
a lower-rank one (the user's versions from before a rank change) is widened exactly, its factors
in the first rows and columns, the trainer's fresh A rows beside them and zero B columns, so it
serves the same delta and the new directions can still learn. Anything else starts from zero.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from macaron_local.adapters.gguf_lora import read_adapter, unpermute_llama_qk_rows
from macaron_local.adapters.peft import gguf_name, qk_permuted_heads
from macaron_local.adapters.validate import BaseModelInfo, validate_adapter
from macaron_local.learn.backends.gguf_weights import name_map


def lora_factors(adapter_path: Path, base: BaseModelInfo, modules: list[str]) -> dict[str, np.ndarray] | None:
    """`{module.lora_A: (r, in), module.lora_B: (out, r)}` in torch/PEFT orientation, or None
    when the file holds a layer the trainer does not have."""
    validate_adapter(adapter_path, base)
    adapter = read_adapter(adapter_path)
    names = name_map(base)
    by_tensor = {gguf_name(names, f"{m}.weight"): m for m in modules}
    factors: dict[str, np.ndarray] = {}
    for tensor, pair in adapter.pairs.items():
        module = by_tensor.get(tensor)
        if module is None:
            return None
        b = pair.b.astype(np.float32)
        if (heads := qk_permuted_heads(base, tensor)) is not None:
            b = unpermute_llama_qk_rows(b, heads)
        factors[f"{module}.lora_A"] = pair.a.astype(np.float32)
        factors[f"{module}.lora_B"] = np.ascontiguousarray(b)
    return factors


def warm_start(backend, adapter_path: Path, base: BaseModelInfo, rank: int, alpha: float) -> str:
    """Load the adapter's factors into the backend's fresh LoRA; returns what happened."""
    adapter = read_adapter(adapter_path)
    if len(adapter.ranks) != 1 or (old_rank := next(iter(adapter.ranks))) > rank:
        return f"started from zero: the deployed version has rank {sorted(adapter.ranks)}, the trainer {rank}"
    if abs(adapter.alpha / old_rank - alpha / rank) > 1e-6:
        return f"started from zero: the deployed version has rank {old_rank}, alpha {adapter.alpha:g}"
    current = backend.lora_weights()
    modules = sorted({name.rpartition(".")[0] for name in current})
    factors = lora_factors(adapter_path, base, modules)
    if factors is None:
        return "started from zero: the deployed version adapts layers the trainer lacks"
    for name, values in factors.items():
        if name in current:
            backend.set_lora_weight(name, widened(name, values, current[name], rank))
    widening = f", rank {old_rank} widened to {rank}" if old_rank < rank else ""
    return f"continued from the deployed version ({len(factors) // 2} layers{widening})"


def widened(name: str, values: np.ndarray, current: np.ndarray, rank: int) -> np.ndarray:
    """`values` (PEFT orientation, the deployed rank) at the trainer's rank and orientation.

    B @ A keeps its value: the extra A rows are the trainer's own fresh ones (so the new
    directions get gradients) and the extra B columns are zero. MLX keeps both transposed."""
    a_half = name.endswith("lora_A")
    outer = values.shape[1] if a_half else values.shape[0]  # in (A) or out (B) features
    peft_shape = (rank, outer) if a_half else (outer, rank)
    fresh = current if current.shape == peft_shape else current.T
    extra = rank - (values.shape[0] if a_half else values.shape[1])
    if extra:
        if a_half:
            values = np.concatenate([values, fresh[rank - extra :].astype(values.dtype)], axis=0)
        else:
            values = np.concatenate([values, np.zeros((outer, extra), values.dtype)], axis=1)
    return values if current.shape == peft_shape else values.T
