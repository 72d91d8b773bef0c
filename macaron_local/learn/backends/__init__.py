"""Trainer backends behind one small interface: load the base, add LoRA, log-probabilities,
step, export. `torch` (transformers + peft; CUDA when present, else CPU) is here; `mlx`
(Apple silicon) implements the same interface."""

from macaron_local.learn.backends.base import Batch, TrainerBackend, make_batch

__all__ = ["Batch", "TrainerBackend", "make_batch"]
