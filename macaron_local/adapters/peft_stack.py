"""Stack PEFT LoRA adapters into one, exactly: for an engine that applies one adapter per request.

vLLM serves one LoRA per request, but the user's personal adapter is meant to sit on top of an
expert. Two LoRAs on one layer add: s1 B1 A1 + s2 B2 A2 = [B1 B2] [s1 A1; s2 A2]. So the stack
is a LoRA of rank r1 + r2 whose A rows are each adapter's A times its own scale (PEFT's
alpha/r, the pattern or rsLoRA form included, times the scale the session asked for) and whose
alpha equals its rank (scaling 1). A module only one adapter targets gets zero rows from the
other. Nothing is approximated: the stacked update equals the sum of the two, to float32.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from macaron_local.adapters.peft import SafetensorsFile, _module_scale
from macaron_local.adapters.peft_config import check_config, module_of, read_config
from macaron_local.errors import AdapterError

WEIGHTS = "adapter_model.safetensors"


def _pairs(folder: Path) -> tuple[dict, dict[str, tuple[np.ndarray, np.ndarray]]]:
    config = read_config(folder / "adapter_config.json")
    check_config(config, folder)
    weights = SafetensorsFile(folder / WEIGHTS)
    halves: dict[str, dict[str, str]] = {}
    for key in weights.names():
        found = module_of(key)
        if found is None:
            continue
        module, marker = found
        if marker not in (".lora_A.", ".lora_B."):
            raise AdapterError(f"{folder}: {key}: only lora_A/lora_B pairs can be stacked")
        halves.setdefault(module, {})[marker] = key
    pairs = {}
    for module, half in halves.items():
        if set(half) != {".lora_A.", ".lora_B."}:
            raise AdapterError(f"{folder}: {module} has half a LoRA pair")
        a, b = weights.read(half[".lora_A."]), weights.read(half[".lora_B."])
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{folder}: {module}: only 2-D pairs of one rank can be stacked")
        pairs[module] = (a, b)
    return config, pairs


def stack_peft(adapters: Sequence[tuple[Path, float]], out_dir: Path) -> Path:
    """Write the stack of `adapters` ((PEFT folder, scale) pairs, applied together) to
    `out_dir` as a PEFT folder (written whole, then renamed into place)."""
    from safetensors.numpy import save_file

    if not adapters:
        raise AdapterError("nothing to stack")
    loaded = [(_pairs(Path(folder)), float(scale)) for folder, scale in adapters]
    modules = sorted({m for (_, pairs), _ in loaded for m in pairs})
    ranks = []
    for (config, pairs), _ in loaded:
        found = {a.shape[0] for a, _ in pairs.values()}
        if len(found) != 1 or "rank_pattern" in config and config["rank_pattern"]:
            raise AdapterError("stacking needs adapters of one rank per adapter")
        ranks.append(found.pop())
    tensors: dict[str, np.ndarray] = {}
    for module in modules:
        shape = next(pairs[module] for (_, pairs), _ in loaded if module in pairs)
        out_features, in_features = shape[1].shape[0], shape[0].shape[1]
        a_rows, b_cols = [], []
        for ((config, pairs), scale), rank in zip(loaded, ranks, strict=True):
            if module in pairs:
                a, b = pairs[module]
                if a.shape[1] != in_features or b.shape[0] != out_features:
                    raise AdapterError(f"{module}: the adapters disagree on its shape")
                factor = scale * _module_scale(config, module.removeprefix("base_model.model."), rank)
                a_rows.append(a * np.float32(factor))
                b_cols.append(b)
            else:
                a_rows.append(np.zeros((rank, in_features), np.float32))
                b_cols.append(np.zeros((out_features, rank), np.float32))
        tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(np.concatenate(a_rows, axis=0), np.float32)
        tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(np.concatenate(b_cols, axis=1), np.float32)
    total = sum(ranks)
    first = loaded[0][0][0]
    config = {
        **{k: v for k, v in first.items() if k not in ("alpha_pattern", "rank_pattern", "use_rslora")},
        "r": total,
        "lora_alpha": total,
        "use_rslora": False,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
    }
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    save_file(tensors, str(staging / WEIGHTS))
    (staging / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".old")
        os.replace(out_dir, old)
        os.replace(staging, out_dir)
        import shutil

        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out_dir)
    return out_dir
