"""How two LoRA adapters differ in what they do to the base: per tensor, the Frobenius norm of
each weight update (scale * B @ A) and of their difference.

Two adapters can have unrelated A and B factors and still make the same update, so factors are
never compared directly. The updates themselves are (out x in), far too big to build for a large
model; with rank r, every norm and inner product reduces to r x r products:
    <B1 A1, B2 A2>_F = sum((B1^T B2) * (A1 A2^T)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from macaron_local.adapters.gguf_lora import read_adapter, update_factors


@dataclass(frozen=True)
class TensorChange:
    tensor: str
    norm_old: float
    norm_new: float
    distance: float  # ||update_new - update_old||_F

    @property
    def relative(self) -> float:
        return self.distance / self.norm_old if self.norm_old else math.inf if self.distance else 0.0


@dataclass(frozen=True)
class AdapterDiff:
    changes: list[TensorChange]

    @property
    def distance(self) -> float:
        return math.sqrt(sum(c.distance**2 for c in self.changes))

    @property
    def norm_old(self) -> float:
        return math.sqrt(sum(c.norm_old**2 for c in self.changes))

    @property
    def norm_new(self) -> float:
        return math.sqrt(sum(c.norm_new**2 for c in self.changes))

    def largest(self, n: int = 5) -> list[TensorChange]:
        return sorted(self.changes, key=lambda c: c.distance, reverse=True)[:n]


def _inner(x: tuple[np.ndarray, np.ndarray], y: tuple[np.ndarray, np.ndarray]) -> float:
    """<L1 R1, L2 R2>_F for updates given as factor pairs (rank-sized products only)."""
    (l1, r1), (l2, r2) = x, y
    return float(np.sum((l1.T @ l2) * (r1 @ r2.T)))


def diff_adapters(old: Path | None, new: Path) -> AdapterDiff:
    """Compare `new` with `old` (None: no adapter, so every distance is the new update's norm).
    Both files must have been validated against the same base."""
    new_adapter = read_adapter(new)
    old_adapter = read_adapter(old) if old is not None else None
    old_pairs = old_adapter.pairs if old_adapter else {}
    changes = []
    for tensor in sorted(set(old_pairs) | set(new_adapter.pairs)):
        n = update_factors(new_adapter, tensor) if tensor in new_adapter.pairs else None
        o = update_factors(old_adapter, tensor) if old_adapter and tensor in old_pairs else None
        nn_ = _inner(n, n) if n else 0.0
        oo = _inner(o, o) if o else 0.0
        no = _inner(n, o) if n and o else 0.0
        changes.append(TensorChange(tensor, math.sqrt(oo), math.sqrt(nn_), math.sqrt(max(nn_ + oo - 2 * no, 0.0))))
    return AdapterDiff(changes)
