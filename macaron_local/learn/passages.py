"""Plain text the learner keeps the language model on, next to the user's feedback.

A night's loss looks only at chat replies: the policy gradient, the KL on the samples and the
SFT on corrections all score tokens after a chat prompt. Nothing in it sees plain text, and the
gate's first check is exactly that: the regression passages' NLL, at most +2% over the bare
experts. Measured on the embedded model, a night's candidates drifted past that limit after 18
to 36 of a second night's 69 steps, and a night that starts from a deployed version near the
limit had no room to learn anything new.

So every step also scores `passages_per_step` short encyclopedic passages (learn/data/passages.json,
written for this project and disjoint from the regression set), as rows of the same batch, and
adds `passage_weight` x `losses.excess_nll` against the bare experts: tokens the adapter made
less likely cost what they lost. This is the pretraining mix of InstructGPT's PPO-ptx, one-sided
so the adapter gains nothing by memorising the passages. The reference is the bare experts, not
the deployed version: the budget the gate enforces is against the base, so every night pays back
whatever drift earlier nights left.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources

import numpy as np

from macaron_local.engine import Engine
from macaron_local.learn import losses
from macaron_local.learn.backends.base import Batch, Objective, TrainerBackend, at_scored_positions, make_batch


def load_passages() -> list[str]:
    text = resources.files("macaron_local.learn.data").joinpath("passages.json").read_text("utf-8")
    return list(json.loads(text)["passages"])


def passage_tokens(engine: Engine, passages: Sequence[str] | None = None) -> list[list[int]]:
    """Each passage as the engine tokenizes plain text (BOS first, as the gate scores it)."""
    texts = load_passages() if passages is None else passages
    return [engine.tokenize(text, add_bos=True, special=False) for text in texts]


class PassageGuard:
    """The passages of each step, their reference log-probabilities, and the loss term.

    Passages rotate (step s takes the next `per_step` of them), so a night of n steps sees
    n x per_step passages in turn. The reference is computed once per passage and expert group
    (`backend.reference_logprobs`: the LoRA off, the group's expert under it), since the bare
    experts do not change during a night."""

    def __init__(self, tokens: Sequence[Sequence[int]], per_step: int, weight: float) -> None:
        self.tokens = [list(t) for t in tokens if len(t) > 1]
        self.per_step = per_step if self.tokens and weight > 0 else 0
        self.weight = weight
        self._reference: dict[tuple[str, int], np.ndarray] = {}

    def indices(self, step: int) -> list[int]:
        n = len(self.tokens)
        return [(step * self.per_step + i) % n for i in range(min(self.per_step, n))]

    def rows(self, step: int) -> tuple[list[list[int]], list[list[int]]]:
        """(prompts, completions) to append to the step's batch: the first token is the context,
        every later one is scored, as `regression.passage_nll` scores a passage."""
        chosen = [self.tokens[i] for i in self.indices(step)]
        return [t[:1] for t in chosen], [t[1:] for t in chosen]

    def _reference_for(self, backend: TrainerBackend, group: str, index: int) -> np.ndarray:
        key = (group, index)
        if key not in self._reference:
            tokens = self.tokens[index]
            batch = make_batch([tokens[:1]], [tokens[1:]])
            values = backend.to_numpy(backend.reference_logprobs(batch))[0]
            self._reference[key] = values[np.asarray(batch.mask[0]) != 0]
        return self._reference[key]

    def guard(self, objective: Objective, backend: TrainerBackend, batch: Batch, rows: int, step: int, group: str):
        """`objective` on the batch's first `rows` rows (the step's samples), plus the passage
        term on the rest. `batch` is the step's samples followed by `rows(step)`."""
        cached = [self._reference_for(backend, group, index) for index in self.indices(step)]
        reference_arr = backend.asarray(at_scored_positions(batch.rows(slice(rows, None)), cached))
        weight = self.weight

        def guarded(logp, held_to, mask_arr):
            loss, parts = objective(logp[:rows], held_to[:rows], mask_arr[:rows])
            kept = losses.excess_nll(logp[rows:], reference_arr, mask_arr[rows:])
            return loss + weight * kept, {**parts, "passages": kept}

        return guarded
