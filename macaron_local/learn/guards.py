"""Rows the learner holds in place next to a step's samples: text scored in the same batch, each
token one-sided against a fixed reference (`losses.excess_nll`), so the adapter pays for what it
made less likely and gains nothing for making it more likely.

Three kinds hold this way: plain-text passages and the anchors' known tokens, held to the bare
experts (learn/passages.py, learn/anchor_hold.py), and the lessons earlier nights taught, held
to the deployed version (learn/lesson_guard.py); the corrections' extra SFT rows
(learn/imitation.py) share the plumbing. A guard's rows rotate (step s takes the next
`per_step` of those scored under the step's expert), and each row's reference is computed once
per expert underneath and cached, since it does not change during a night.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Self

import numpy as np

from macaron_local.learn import losses
from macaron_local.learn.backends.base import Batch, TrainerBackend, at_scored_positions, make_batch

#: (expert group, prompt tokens, completion tokens, held mask): one row a builder found.
MaskedRow = tuple[str | None, Sequence[int], Sequence[int], np.ndarray]

#: A guard's term as a function of its own rows' log-probabilities and token mask.
Term = Callable[[object, object], object]


class RowGuard:
    """`(prompt, completion)` rows with an optional per-token mask (1 = held), the expert group
    each row belongs to (None: any), and the weight of their term in the loss."""

    name = "rows"

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        per_step: int,
        weight: float,
        masks: Sequence[Sequence[float]] | None = None,
        groups: Sequence[str | None] | None = None,
    ) -> None:
        self.prompts = [list(p) for p in prompts]
        self.completions = [list(c) for c in completions]
        self.masks = [list(m) for m in masks] if masks is not None else None
        self.groups = list(groups) if groups is not None else [None] * len(self.prompts)
        self.per_step = per_step if self.prompts and weight > 0 else 0
        self.weight = weight
        self._reference: dict[tuple[str, int], np.ndarray] = {}

    @classmethod
    def from_masked(cls, rows: Sequence[MaskedRow], per_step: int, weight: float) -> Self:
        """The guard of `(group, prompt, completion, held mask)` rows, as the builders find them."""
        return cls(
            [prompt for _, prompt, _, _ in rows],
            [completion for _, _, completion, _ in rows],
            per_step,
            weight,
            masks=[np.asarray(mask, dtype=np.float32).tolist() for _, _, _, mask in rows],
            groups=[group for group, _, _, _ in rows],
        )

    @property
    def held_tokens(self) -> int:
        """How many tokens the rows' masks hold (0 for a guard without masks)."""
        return int(sum(map(sum, self.masks or [])))

    def begin(self, start: dict[str, np.ndarray] | None) -> None:
        """Called when a night's training starts from LoRA weights `start` (a retrain calls it
        again): references that depend on the start are recomputed."""

    def reference(self, backend: TrainerBackend, batch: Batch) -> np.ndarray:
        """The log-probabilities the rows are held to, as the backend's array (B, T)."""
        raise NotImplementedError

    def indices(self, step: int, group: str = "") -> list[int]:
        mine = [i for i, g in enumerate(self.groups) if g is None or g == group]
        n = len(mine)
        return [mine[(step * self.per_step + i) % n] for i in range(min(self.per_step, n))]

    def rows(self, step: int, group: str = "") -> tuple[list[list[int]], list[list[int]]]:
        """(prompts, completions) to append to the step's batch."""
        chosen = self.indices(step, group)
        return [self.prompts[i] for i in chosen], [self.completions[i] for i in chosen]

    def _reference_for(self, backend: TrainerBackend, group: str, index: int) -> np.ndarray:
        key = (group, index)
        if key not in self._reference:
            batch = make_batch([self.prompts[index]], [self.completions[index]])
            values = backend.to_numpy(self.reference(backend, batch))[0]
            self._reference[key] = values[np.asarray(batch.mask[0]) != 0]
        return self._reference[key]

    def term(self, backend: TrainerBackend, batch: Batch, step: int, group: str) -> Term:
        """The guard's loss on `batch` (its own rows for `step`, in `rows` order), unweighted."""
        chosen = self.indices(step, group)
        reference = backend.asarray(
            at_scored_positions(batch, [self._reference_for(backend, group, i) for i in chosen])
        )
        held = None
        if self.masks is not None:
            held = backend.asarray(at_scored_positions(batch, [self.masks[i] for i in chosen]))

        def held_term(logp, mask_arr):
            return losses.excess_nll(logp, reference, mask_arr if held is None else mask_arr * held)

        return held_term


def guarded_rows(guards: Sequence[RowGuard], step: int, group: str):
    """Each guard with its rows for this step: [(guard, prompts, completions)], empty ones left out."""
    picked = [(g, *g.rows(step, group)) for g in guards]
    return [(g, p, c) for g, p, c in picked if p]


def with_guards(objective, guards, backend: TrainerBackend, batch: Batch, rows: int, step: int, group: str):
    """`objective` on the batch's first `rows` rows (the step's samples), plus each guard's
    weighted term on the rows that follow, in `guarded_rows` order."""
    terms = []
    offset = rows
    for guard, prompts, _ in guards:
        end = offset + len(prompts)
        terms.append((offset, end, guard, guard.term(backend, batch.rows(slice(offset, end)), step, group)))
        offset = end

    def guarded(logp, held_to, mask_arr):
        loss, parts = objective(logp[:rows], held_to[:rows], mask_arr[:rows])
        parts = dict(parts)
        for start, end, guard, term in terms:
            value = term(logp[start:end], mask_arr[start:end])
            loss = loss + guard.weight * value
            parts[guard.name] = value
        return loss, parts

    return guarded
