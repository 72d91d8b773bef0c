"""Checks on a PEFT LoRA directory before any of it is converted, and on where it will go.

`adapters/peft.py` converts what it is given. A config of the wrong shape (alpha a string,
`r = 0`, `alpha_pattern` a list, the whole config a list), a tensor that is 1-D or half of a
pair, or an output path that cannot be written used to end deep inside numpy or the writer
with a traceback; options that change what the adapter means (`use_dora`, `modules_to_save`)
were silently dropped, so the converted file would not behave like the PEFT adapter it came
from. Each is refused here with one line that names the key or the tensor.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from macaron_local.errors import AdapterError
from macaron_local.untrusted import load_json, read_text

#: PEFT's special value for "every linear layer but the output head".
ALL_LINEAR = "all-linear"
HALF_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B")
#: The largest magnitude each storage type holds (Q8_0 keeps an F16 scale per block).
STORAGE_MAX = {"F16": 65504.0, "Q8_0": 65504.0, "BF16": 3.38e38, "F32": 3.4e38}


def read_config(path: Path) -> dict[str, Any]:
    """adapter_config.json as a dict: standard JSON, bounded, an object at the top."""
    where = f"{path.parent}: unreadable PEFT adapter config {path.name}"
    config = load_json(read_text(path, "PEFT adapter config", error=AdapterError), where, AdapterError)
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: the PEFT config must be a JSON object (got {type(config).__name__})")
    return config


def _number(config: dict[str, Any], key: str, where: Path, *, whole: bool) -> None:
    if key not in config:
        return
    value = config[key]
    kind_ok = isinstance(value, int) if whole else isinstance(value, int | float)
    if isinstance(value, bool) or not kind_ok or not math.isfinite(value) or value <= 0:
        what = "a whole number >= 1" if whole else "a positive number"
        raise AdapterError(f"{where}: {key} in the PEFT config must be {what} (got {value!r})")


def _pattern(config: dict[str, Any], key: str, where: Path, *, whole: bool) -> None:
    value = config.get(key)
    if value is None:
        return
    if not isinstance(value, dict):
        raise AdapterError(f"{where}: {key} in the PEFT config must be an object of module: value")
    for module, number in value.items():
        _number({f"{key}[{module!r}]": number}, f"{key}[{module!r}]", where, whole=whole)


def check_config(config: dict[str, Any], where: Path) -> None:
    """Types and ranges of every key the converter reads, and the options it cannot honour."""
    _number(config, "r", where, whole=True)
    _number(config, "lora_alpha", where, whole=False)
    _pattern(config, "alpha_pattern", where, whole=False)
    _pattern(config, "rank_pattern", where, whole=True)
    if "peft_type" in config and not isinstance(config["peft_type"], str):
        raise AdapterError(f"{where}: peft_type in the PEFT config must be text (got {config['peft_type']!r})")
    if not isinstance(config.get("use_rslora", False), bool):
        raise AdapterError(f"{where}: use_rslora in the PEFT config must be true or false")
    if config.get("use_dora"):
        raise AdapterError(f"{where}: a DoRA adapter (use_dora) has a magnitude vector llama.cpp cannot apply")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{where}: modules_to_save holds full copies of modules {config['modules_to_save']!r}; "
            "a GGUF LoRA cannot carry them"
        )
    targets = config.get("target_modules")
    listed = isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    if not (targets is None or isinstance(targets, str) or listed):
        raise AdapterError(f"{where}: target_modules in the PEFT config must be a list of names or a pattern")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        try:
            re.compile(targets)
        except re.error as exc:
            raise AdapterError(f"{where}: target_modules {targets!r} is not a valid pattern ({exc})") from None


def module_of(key: str) -> tuple[str, str] | None:
    """(module path, marker) of a PEFT tensor key, prefix included; None: not a LoRA half."""
    for marker in HALF_MARKERS:
        if marker in key:
            return key.split(marker)[0], marker
    return None


def _targeted(module: str, targets: Any) -> bool:
    if targets is None or targets == ALL_LINEAR:
        return True
    if isinstance(targets, str):  # PEFT matches a pattern against the whole module name
        return re.fullmatch(targets, module.removeprefix("base_model.model.")) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def check_tensors(config: dict[str, Any], shapes: dict[str, tuple[int, ...]], where: Path) -> None:
    """Every tensor (by its header shape) a half of a whole pair with at least two dimensions and
    one rank, and every module one that target_modules names. Values are the writer's to check
    (finite, within the storage type) as it encodes each tensor."""
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        found = module_of(key)
        if found is None:
            continue  # the converter names it ("is not a LoRA A/B weight")
        module, marker = found
        if len(shape) < 2:
            raise AdapterError(f"{where}: tensor {key} has shape {tuple(shape)}; a LoRA half has 2 or more dims")
        modules.setdefault(module, {})[marker] = shape
    # target_parameters (PEFT's LoRA on stacked MoE expert weights) names modules another way.
    targets = None if config.get("target_parameters") else config.get("target_modules")
    for module, halves in sorted(modules.items()):
        embedding = any("embedding" in m for m in halves)
        a_key, b_key = (".lora_embedding_A", ".lora_embedding_B") if embedding else (".lora_A.", ".lora_B.")
        if set(halves) != {a_key, b_key}:
            have = ", ".join(m.strip(".") for m in sorted(halves))
            raise AdapterError(f"{where}: module {module} has {have} but not both halves of a LoRA pair")
        a, b = halves[a_key], halves[b_key]
        rank_a = a[0] if embedding else a[-2]
        if len(a) == len(b) == 2 and (rank_a < 1 or b[-1] != rank_a):
            raise AdapterError(
                f"{where}: module {module}: lora_A {tuple(a)} and lora_B {tuple(b)} disagree on the rank"
            )
        if not _targeted(module, targets):
            raise AdapterError(f"{where}: module {module} has LoRA weights but target_modules {targets!r} omits it")


def check_output(out_path: str | os.PathLike[str]) -> None:
    """The output can be written: its folder exists and is writable, and it is not a folder."""
    out = Path(out_path)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise AdapterError(f"cannot write {out}: it is a directory")
    if not parent.is_dir():
        raise AdapterError(f"cannot write {out}: {parent} is not an existing folder")
    if not os.access(parent, os.W_OK):
        raise AdapterError(f"cannot write {out}: the folder {parent} is not writable")
