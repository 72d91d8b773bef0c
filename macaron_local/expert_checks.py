"""What a published PEFT expert must declare before it is converted and served.

Mind Lab's launcher refuses an adapter whose `r` is not the rank the experts were trained at, or
whose `base_model_name_or_path` does not name the base they were trained on. A manifest states
the same expectations (`expect_rank`, `expect_base`) and `macaron models pull` checks them on the
small adapter_config.json, before the multi-gigabyte weights are fetched or converted, so a wrong
or swapped upload is refused in one line instead of turning into a broken adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

from macaron_local.catalog import Source
from macaron_local.errors import AdapterError


def check_peft_config(config_path: Path, source: Source, label: str) -> dict:
    """Return the parsed adapter_config.json, or raise AdapterError (one line) naming what is wrong."""
    where = f"{label} ({source.repo} {source.subfolder or '.'})"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AdapterError(f"{where}: {config_path.name} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: {config_path.name} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{where}: peft_type is {config.get('peft_type')!r}, not LORA")
    if source.expect_rank is not None:
        rank = config.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank != source.expect_rank:
            raise AdapterError(f"{where}: LoRA rank r is {rank!r}, expected {source.expect_rank}")
    if source.expect_base:
        declared = config.get("base_model_name_or_path")
        if not isinstance(declared, str) or source.expect_base not in declared:
            raise AdapterError(
                f"{where}: declares base {declared!r}, expected one whose name contains {source.expect_base!r}"
            )
    return config
