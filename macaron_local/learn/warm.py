"""Nights that build on each other: start tonight's LoRA from the deployed personal version.

The deployed GGUF adapter is read back into the trainer's LoRA factors (the inverse of the
PEFT -> GGUF export: the same gguf-py name map, llama's q/k rows un-permuted), so a night
continues what the user already has instead of relearning it from zero on a sample of old
episodes. The KL term then holds the night to where it started (`LearnConfig.kl_reference`,
"deployed" by default): held to the base instead, every night pulled what earlier nights taught
back toward the base, and replay had to win it back. The gate still compares with the base, a
stable reference. Only an adapter of the same rank and alpha can be continued; anything else
starts from zero.
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
    if adapter.ranks != {rank} or abs(adapter.alpha - alpha) > 1e-6:
        return f"started from zero: the deployed version has rank {sorted(adapter.ranks)}, alpha {adapter.alpha:g}"
    current = backend.lora_weights()
    modules = sorted({name.rpartition(".")[0] for name in current})
    factors = lora_factors(adapter_path, base, modules)
    if factors is None:
        return "started from zero: the deployed version adapts layers the trainer lacks"
    for name, values in factors.items():
        if name not in current:
            continue
        if current[name].shape != values.shape:  # MLX keeps the transposes
            values = values.T
        backend.set_lora_weight(name, values)
    return f"continued from the deployed version ({len(factors) // 2} layers)"
