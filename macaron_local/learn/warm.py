"""Nights that build on each other: start tonight's LoRA from the deployed personal version.

The deployed GGUF adapter is read back into the trainer's LoRA factors (the inverse of the
PEFT -> GGUF export: the same gguf-py name map, llama's q/k rows un-permuted, qwen35moe's
Gated DeltaNet value heads put back in HF's grouped order), so a night
continues what the user already has instead of relearning it from zero on a sample of old
episodes. The KL term then holds the night to where it started (`LearnConfig.kl_reference`,
"deployed" by default): held to the base instead, every night pulled what earlier nights taught
back toward the base, and replay had to win it back. The gate still compares with the base, a
stable reference. An adapter of the same scale (alpha / rank) and no higher rank is continued:
a lower-rank one (the user's versions from before a rank change) is widened exactly, its factors
in the first rows and columns, the trainer's fresh A rows beside them and zero B columns, so it
serves the same delta and the new directions can still learn. Anything else starts from zero.

What was read back is checked by exporting it again: the export is what parity holds to
llama.cpp every night, so a read-back that exports back to the deployed file's factors is the
version the user is served. One that does not (a layout the read-back got wrong: until stop 58
it left Tall's Gated DeltaNet heads in GGUF order) starts from zero and says so; training on
from a start nobody was served would pass every later check, which compare the trainer with
its own export. Exact, so it holds on a quantized base too, where comparing with llama.cpp
would need parity's loose tolerance.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from macaron_local.adapters import qwen35moe
from macaron_local.adapters.gguf_lora import LoraAdapter, read_adapter, unpermute_llama_qk_rows
from macaron_local.adapters.peft import gguf_name, qk_permuted_heads
from macaron_local.adapters.validate import BaseModelInfo, validate_adapter
from macaron_local.learn.backends.gguf_weights import name_map
from macaron_local.learn.export import export_gguf

#: A read-back's factors may differ from the deployed file's by this share of the tensor's
#: largest value: float32 rounding of the scale the export applies, nothing more.
READ_BACK_TOLERANCE = 1e-5


def lora_factors(adapter_path: Path, base: BaseModelInfo, modules: list[str]) -> dict[str, np.ndarray] | None:
    """`{module.lora_A: (r, in), module.lora_B: (out, r)}` in torch/PEFT orientation, or None
    when the file holds a layer the trainer does not have."""
    validate_adapter(adapter_path, base)
    adapter = read_adapter(adapter_path)
    names = name_map(base)
    by_tensor = {gguf_name(names, f"{hf_module(m)}.weight"): m for m in modules}
    dims = qwen35moe.LinearAttentionDims.from_hparams(base.hparams) if base.architecture == qwen35moe.ARCH else None
    factors: dict[str, np.ndarray] = {}
    for tensor, pair in adapter.pairs.items():
        module = by_tensor.get(tensor)
        if module is None:
            return None
        a, b = pair.a.astype(np.float32), pair.b.astype(np.float32)
        if (heads := qk_permuted_heads(base, tensor)) is not None:
            b = unpermute_llama_qk_rows(b, heads)
        rows, columns = qwen35moe.lora_orders(module, dims) if dims is not None else (None, None)
        if rows is not None:
            b = b[np.argsort(rows)]
        if columns is not None:
            a = a[:, np.argsort(columns)]
        factors[f"{module}.lora_A"] = np.ascontiguousarray(a)
        factors[f"{module}.lora_B"] = np.ascontiguousarray(b)
    return factors


def hf_module(module: str) -> str:
    """The checkpoint's module path for a trainer module: mlx-lm wraps qwen3_5's decoder in
    `language_model` (`language_model.model.layers.0...`), which the export drops too."""
    return module.removeprefix("language_model.")


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
            backend.set_lora_weight(name, widened(name, values, current[name], rank, backend.lora_transposed))
    if (miss := read_back_miss(backend, adapter, base, old_rank, adapter_path.parent)) is not None:
        for name, values in current.items():
            backend.set_lora_weight(name, values)
        return f"started from zero: the deployed version did not read back exactly ({miss})"
    widening = f", rank {old_rank} widened to {rank}" if old_rank < rank else ""
    return f"continued from the deployed version ({len(factors) // 2} layers{widening}, read back exactly)"


def read_back_miss(backend, deployed: LoraAdapter, base: BaseModelInfo, old_rank: int, scratch_dir: Path) -> str | None:
    """Export the backend's LoRA (into a temporary file under `scratch_dir`) and compare it with
    the deployed adapter, its first `old_rank` ranks (a widened LoRA's others are fresh A rows
    under zero B columns): None when every factor matches, else the worst tensor and by how
    much it is off."""
    with tempfile.TemporaryDirectory(prefix=".read-back-", dir=scratch_dir) as scratch:
        again = read_adapter(export_gguf(backend, base, Path(scratch) / "read-back.gguf"))
    worst, name_of_worst = 0.0, ""
    for name, pair in deployed.pairs.items():
        if name not in again.pairs:
            return f"{name} is missing"
        other = again.pairs[name]
        for mine, theirs in ((pair.a, other.a[:old_rank]), (pair.b, other.b[:, :old_rank])):
            if mine.shape != theirs.shape:
                return f"{name} has shape {theirs.shape}, not {mine.shape}"
            off = float(np.abs(mine - theirs).max()) / max(float(np.abs(mine).max()), 1e-30)
            if off > worst:
                worst, name_of_worst = off, name
    if worst > READ_BACK_TOLERANCE:
        return f"{name_of_worst} differs by {worst:.2g}x its largest value"
    return None


def widened(name: str, values: np.ndarray, current: np.ndarray, rank: int, transposed: bool) -> np.ndarray:
    """`values` (PEFT orientation, the deployed rank) at the trainer's rank and orientation
    (`transposed`: the backend's `lora_transposed`, mlx-lm keeps both factors transposed).

    B @ A keeps its value: the extra A rows are the trainer's own fresh ones (so the new
    directions get gradients) and the extra B columns are zero."""
    a_half = name.endswith("lora_A")
    fresh = current.T if transposed else current
    extra = rank - (values.shape[0] if a_half else values.shape[1])
    if extra:
        if a_half:
            values = np.concatenate([values, fresh[rank - extra :].astype(values.dtype)], axis=0)
        else:
            values = np.concatenate([values, np.zeros((values.shape[0], extra), values.dtype)], axis=1)
    return values.T if transposed else values
