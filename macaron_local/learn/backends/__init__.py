"""Trainer backends behind one small interface: load the base, add LoRA, log-probabilities,
step, export. `torch` (transformers + peft; CUDA when present, else CPU) and `mlx` (mlx-lm;
Metal on Apple silicon, the CPU build elsewhere) pass the same conformance tests."""

from __future__ import annotations

import importlib.util
import platform
import sys

from macaron_local.errors import MacaronError
from macaron_local.learn.backends.base import Batch, StepOutcome, TrainerBackend, make_batch

__all__ = ["BACKENDS", "Batch", "StepOutcome", "TrainerBackend", "choose_backend", "make_backend", "make_batch"]

BACKENDS = ("auto", "torch", "mlx")


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def choose_backend(name: str = "auto") -> str:
    """`auto`: MLX on Apple silicon (its GPU), else torch (CUDA when present), else MLX's CPU build."""
    if name not in BACKENDS:
        raise MacaronError(f"unknown trainer backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    apple_silicon = sys.platform == "darwin" and platform.machine() == "arm64"
    if apple_silicon and _installed("mlx", "mlx_lm"):
        return "mlx"
    if _installed("torch", "transformers", "peft"):
        return "torch"
    if _installed("mlx", "mlx_lm"):
        return "mlx"
    raise MacaronError("learning needs a trainer: pip install 'macaron-local[torch]' (or '[mlx]' on a Mac)")


def make_backend(name: str = "auto", lr: float = 1e-4) -> TrainerBackend:
    chosen = choose_backend(name)
    if chosen == "mlx":
        from macaron_local.learn.backends.mlx_backend import MlxBackend

        return MlxBackend(lr=lr)
    from macaron_local.learn.backends.torch_backend import TorchBackend

    return TorchBackend(lr=lr)
