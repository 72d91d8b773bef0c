"""What every trainer backend offers, and the padded batch they all consume.

The shape follows Tinker's trainer API: score a batch (with or without the LoRA), take a step
on a loss, export the weights for the sampler. Token ids come from the engine's own chat
template and tokenizer, so the trainer scores exactly the sequence llama.cpp generated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class Batch:
    """Right-padded token ids; `mask` is 1 on completion tokens (the ones that are scored)."""

    input_ids: list[list[int]]  # (B, T): prompt + completion, padded
    targets: list[list[int]]  # (B, T): input_ids shifted left by one (next token), padded
    mask: list[list[float]]  # (B, T): 1.0 where targets[b][t] is a completion token

    @property
    def size(self) -> int:
        return len(self.input_ids)

    @property
    def n_tokens(self) -> int:
        return int(sum(sum(row) for row in self.mask))

    def rows(self, which: slice) -> Batch:
        """Some of the batch's rows, at the batch's width (so positions line up with the whole)."""
        return Batch(self.input_ids[which], self.targets[which], self.mask[which])


def make_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int = 0) -> Batch:
    """Pack (prompt, completion) pairs so position t predicts token t+1; only completion
    tokens count in the loss."""
    sequences = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in sequences) - 1
    input_ids, targets, mask = [], [], []
    for prompt, sequence in zip(prompts, sequences, strict=True):
        row_in = sequence[:-1]
        row_target = sequence[1:]
        row_mask = [1.0 if t >= len(prompt) - 1 else 0.0 for t in range(len(row_in))]
        pad = width - len(row_in)
        input_ids.append(row_in + [pad_id] * pad)
        targets.append(row_target + [pad_id] * pad)
        mask.append(row_mask + [0.0] * pad)
    return Batch(input_ids, targets, mask)


def at_scored_positions(batch: Batch, per_row: Sequence[Sequence[float]]) -> np.ndarray:
    """(B, T) float32 with row b's values laid on row b's scored (mask != 0) positions in order,
    0 elsewhere: per-token numbers computed outside the batch (the sampler's log-probabilities,
    a cached reference) lined up with the trainer's. Rows beyond `per_row` stay 0."""
    mask = np.asarray(batch.mask, dtype=np.float32)
    out = np.zeros_like(mask)
    for row, values in enumerate(per_row):
        positions = np.flatnonzero(mask[row])[: len(values)]
        out[row, positions] = np.asarray(values, dtype=np.float32)[: len(positions)]
    return out


def real_lengths(batch: Batch) -> list[int]:
    """Each row's unpadded length: its last scored position + 1 (a row with nothing scored keeps
    the batch's width). Positions after it only see padding and are never needed."""
    lengths = []
    for row in batch.mask:
        scored = [i for i, m in enumerate(row) if m]
        lengths.append(scored[-1] + 1 if scored else len(row))
    return lengths


def length_buckets(lengths: Sequence[int], overhead: int = 48) -> list[list[int]]:
    """Row indices split into sub-batches so that padding costs least: a forward pass over a
    sub-batch costs about (rows x its longest row) positions plus `overhead` positions' worth of
    fixed cost per call. Rows sorted by length are cut where that total is smallest (an exact
    DP over the cut points). On a CPU, where the trainer's time is proportional to the positions
    it computes, a batch mixing long chat samples with short passages or short corrections pays
    for the long rows' width on every short row; the buckets do not."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[k]: cheapest split of the k longest rows
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):  # rows order[start:end] form one bucket, its longest first
            cost = best[start] + overhead + (end - start) * lengths[order[start]]
            if cost < best[end]:
                best[end], cut[end] = cost, start
    buckets, end = [], n
    while end > 0:
        buckets.append(sorted(order[cut[end] : end]))
        end = cut[end]
    return buckets[::-1]


def sub_batches(batch: Batch) -> list[tuple[list[int], Batch]]:
    """The batch's `length_buckets`, each as (its row indices, those rows cut to the longest one's
    real length): what a backend runs a forward pass on, before putting rows back in order."""
    lengths = real_lengths(batch)
    out = []
    for bucket in length_buckets(lengths):
        cut = max(lengths[i] for i in bucket)
        rows = (batch.input_ids, batch.targets, batch.mask)
        out.append((bucket, Batch(*([table[i][:cut] for i in bucket] for table in rows))))
    return out


#: An objective: (logp with LoRA, reference logp, mask) -> (loss to minimise, named parts to log).
#: Built from `losses`, it runs unchanged on any backend's arrays.
Objective = Callable[[Any, Any, Any], tuple[Any, Mapping[str, Any]]]


@dataclass(frozen=True)
class StepOutcome:
    loss: float
    parts: dict[str, float]
    grad_norm: float


def step_is_finite(loss: float, grad_norm: float) -> bool:
    """Whether a step may be applied. A backend skips one whose loss or gradient norm is not
    finite, as mixed-precision loops skip an overflowed step: clipping scales a NaN gradient to
    NaN, one NaN step spoils the LoRA for good, and its export is refused (a ratings night at
    stop 40 ended so). The loop counts the skipped ones by the same rule."""
    return math.isfinite(loss) and math.isfinite(grad_norm)


class TrainerBackend(Protocol):
    name: str
    #: How `lora_weights` lays the factors out: False for PEFT's A (r, in) and B (out, r), True
    #: for mlx-lm's A (in, r) and B (r, out). Stated, not guessed from shapes: a square factor
    #: (rank equal to a layer's width, as rank 32 on Tall's 32-head `in_proj_a`) reads both ways.
    lora_transposed: bool

    def load(self, base_gguf: Path, checkpoint: str | None = None) -> None:
        """Load the base model: from the GGUF the engine runs, or a checkpoint the manifest names."""

    def linear_weight_names(self) -> list[str]:
        """HF names of the base's linear weights (`model.layers.0.self_attn.q_proj.weight`, ...)."""

    def fold_in(self, deltas: Mapping[str, np.ndarray]) -> None:
        """Add frozen deltas (the slot's expert adapter) to base weights, before `add_lora`."""

    def add_lora(self, rank: int = 8, alpha: float = 16.0, seed: int = 0) -> None:
        """Wrap every linear layer (attention and MLP) with a LoRA whose B starts at zero."""

    def reset_optimizer(self, lr: float) -> None:
        """Start the optimizer afresh at learning rate `lr`."""

    def logprobs(self, batch: Batch) -> Any:
        """Per-token log-probabilities (B, T) of `batch.targets` under base + LoRA (0 before the
        first completion position, which is never scored)."""

    def reference_logprobs(self, batch: Batch) -> Any:
        """The same under the base alone (LoRA off): the KL reference, no gradients."""

    def asarray(self, values: np.ndarray) -> Any:
        """Numbers as this backend's float array (on its device)."""

    def to_numpy(self, values: Any) -> np.ndarray:
        """A backend array as float64 numpy."""

    def train_step(self, batch: Batch, objective: Objective, with_reference: bool = True) -> StepOutcome:
        """One optimizer step on `objective` (gradients clipped to norm 1)."""

    def gradients(self, batch: Batch, objective: Objective) -> dict[str, np.ndarray]:
        """The objective's gradient for every LoRA parameter, without stepping (for checks)."""

    def lora_weights(self) -> dict[str, np.ndarray]:
        """Every LoRA parameter by name, as numpy."""

    def set_lora_weight(self, name: str, values: np.ndarray) -> None:
        """Overwrite one LoRA parameter (tests, finite differences)."""

    def save_peft(self, directory: Path) -> Path:
        """Write the LoRA as a PEFT directory (adapter_config.json + adapter_model.safetensors)."""


def first_scored_position(batch: Batch) -> int:
    """The earliest position any row scores: logits before it are never needed, so a backend
    computes the output layer (vocab-sized, the most expensive matmul of a small model) only
    from there on."""
    firsts = [next(i for i, m in enumerate(row) if m) for row in batch.mask if any(row)]
    return min(firsts) if firsts else 0
