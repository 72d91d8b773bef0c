"""From trainer weights to a GGUF adapter the engine serves, and the check that it computes the
same thing.

Export goes PEFT directory -> our PEFT->GGUF converter (validated against the base). The parity
check compares what the adapter *changes*: for each held-out token, (engine with adapter - engine
without) against (trainer with LoRA - trainer without). Comparing changes cancels the difference
between llama.cpp's quantized base and the trainer's dequantized copy, which is not the
adapter's doing; on a float32 base both ways agree to float rounding. On a quantized base the
cancellation is only first-order: what is left grows with the effect itself, so a token may
differ by a fixed floor plus a share of how far the adapter moved it (`rel_tolerance`). A
failed check blocks deployment.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from macaron_local.adapters.peft import convert_peft_dir
from macaron_local.adapters.validate import BaseModelInfo
from macaron_local.engine import Engine
from macaron_local.learn.backends.base import TrainerBackend, make_batch


def export_gguf(
    backend: TrainerBackend,
    base: BaseModelInfo,
    out: Path,
    task_name: str | None = None,
    dtype: str = "F32",
    keep_peft: bool = False,
) -> Path:
    """Write the backend's LoRA as a validated GGUF adapter at `out` (atomically).

    With `keep_peft`, the PEFT folder it was converted from stays next to it
    (`out.with_suffix(".peft")`): an engine that loads PEFT, not GGUF (vLLM), serves that.
    """
    with tempfile.TemporaryDirectory(prefix=".peft-", dir=out.parent) as tmp:  # same filesystem: renamed
        saved = Path(tmp) / "adapter"
        backend.save_peft(saved)
        file = convert_peft_dir(saved, base, out, dtype=dtype, task_name=task_name)
        if keep_peft:
            folder = out.with_suffix(".peft")
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(saved, folder)
        return file


@dataclass(frozen=True)
class ParityReport:
    max_abs_diff: float
    mean_abs_diff: float
    tolerance: float
    n_tokens: int
    #: The share of each token's effect (trainer side, nats) its difference may add to `tolerance`.
    rel_tolerance: float
    #: The largest `|difference| - rel_tolerance * |effect|` over the tokens: what `ok` judges.
    max_excess: float

    @property
    def ok(self) -> bool:
        return self.max_excess <= self.tolerance

    def summary(self) -> str:
        verdict = "passed" if self.ok else "FAILED"
        allowed = f"{self.tolerance:g}"
        if self.rel_tolerance:
            allowed += f" + {self.rel_tolerance:g} x the token's effect"
        return (
            f"parity {verdict}: adapter effect differs by at most {self.max_abs_diff:.2e} nats "
            f"(mean {self.mean_abs_diff:.2e}) over {self.n_tokens} tokens; tolerance {allowed}"
        )


def judge_parity(
    engine_effects: Sequence[np.ndarray],
    trainer_effects: Sequence[np.ndarray],
    tolerance: float,
    rel_tolerance: float = 0.0,
) -> ParityReport:
    """Each token's effect in the engine against the trainer's: it passes if the two differ by at
    most `tolerance + rel_tolerance * |trainer effect|`. A broken export (stale weights, a wrong
    scale, a missing pair) misses by a large share of the effect; quantization by a small one."""
    pairs = list(zip(engine_effects, trainer_effects, strict=True))
    engine_side = np.concatenate([np.asarray(e, np.float64) for e, _ in pairs]) if pairs else np.zeros(0)
    trainer_side = np.concatenate([np.asarray(t, np.float64) for _, t in pairs]) if pairs else np.zeros(0)
    every = np.abs(engine_side - trainer_side)
    return ParityReport(
        max_abs_diff=float(every.max()) if every.size else 0.0,
        mean_abs_diff=float(every.mean()) if every.size else 0.0,
        tolerance=tolerance,
        n_tokens=int(every.size),
        rel_tolerance=rel_tolerance,
        max_excess=float((every - rel_tolerance * np.abs(trainer_side)).max()) if every.size else 0.0,
    )


def parity_check(
    engine: Engine,
    adapter_path: Path,
    backend: TrainerBackend,
    samples: Sequence[tuple[Sequence[int], Sequence[int]]],
    tolerance: float,
    rel_tolerance: float = 0.0,
) -> ParityReport:
    """Compare the adapter's effect on token log-probabilities in llama.cpp and in the trainer."""
    effects = trainer_effects(backend, samples)
    return parity_from_effects(engine, adapter_path, samples, effects, tolerance, rel_tolerance)


def trainer_effects(
    backend: TrainerBackend,
    samples: Sequence[tuple[Sequence[int], Sequence[int]]],
    reference: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """The trainer's side of parity: per sample, the LoRA's effect (tuned - reference) on each
    completion token's log-probability. Kept as numbers, so the sequential nightly plan can free
    the trainer before the engine comes back to compare. `reference`: the samples already read
    without the LoRA (`trainer_logprobs(..., reference=True)`), which a night exporting several
    candidates reads once rather than once per candidate."""
    if reference is None:
        reference = trainer_logprobs(backend, samples, reference=True)
    tuned = trainer_logprobs(backend, samples)
    return [t - b for t, b in zip(tuned, reference, strict=True)]


def trainer_logprobs(
    backend: TrainerBackend, samples: Sequence[tuple[Sequence[int], Sequence[int]]], reference: bool = False
) -> list[np.ndarray]:
    """Per sample, each completion token's log-probability in the trainer: with its LoRA, or
    (`reference`) without it."""
    scored = []
    for prompt, completion in samples:
        batch = make_batch([prompt], [completion])
        mask = np.asarray(batch.mask[0]) > 0
        logprobs = backend.reference_logprobs(batch) if reference else backend.logprobs(batch)
        scored.append(backend.to_numpy(logprobs)[0][mask])
    return scored


def parity_from_effects(
    engine: Engine,
    adapter_path: Path,
    samples: Sequence[tuple[Sequence[int], Sequence[int]]],
    effects: Sequence[np.ndarray],
    tolerance: float,
    rel_tolerance: float = 0.0,
) -> ParityReport:
    """llama.cpp's effect of the exported adapter against the trainer's `effects` (same samples)."""
    handle = engine.load_adapter(adapter_path)
    previous = engine.active_handles()
    engine_effects: list[np.ndarray] = []
    try:
        for prompt, completion in samples:
            engine.set_adapters([])
            engine_base = engine.token_logprobs(prompt, completion)
            engine.set_adapters([handle])
            engine_effects.append(engine.token_logprobs(prompt, completion) - engine_base)
    finally:
        engine.set_adapters(previous)
    return judge_parity(engine_effects, effects, tolerance, rel_tolerance)
