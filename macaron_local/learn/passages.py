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

from macaron_local.engine import Engine
from macaron_local.learn.backends.base import Batch, TrainerBackend
from macaron_local.learn.guards import RowGuard


def load_passages() -> list[str]:
    text = resources.files("macaron_local.learn.data").joinpath("passages.json").read_text("utf-8")
    return list(json.loads(text)["passages"])


def passage_tokens(engine: Engine, passages: Sequence[str] | None = None) -> list[list[int]]:
    """Each passage as the engine tokenizes plain text (BOS first, as the gate scores it)."""
    texts = load_passages() if passages is None else passages
    return [engine.tokenize(text, add_bos=True, special=False) for text in texts]


class PassageGuard(RowGuard):
    """The passages as guarded rows (learn/guards.py), held to the bare experts.

    Passages rotate (step s takes the next `per_step` of them), so a night of n steps sees
    n x per_step passages in turn. Each passage's first token is the context and every later
    one is scored, as `regression.passage_nll` scores a passage. The reference is the LoRA off
    (`backend.reference_logprobs`, the group's expert under it), since the bare experts do not
    change during a night."""

    name = "passages"

    def __init__(self, tokens: Sequence[Sequence[int]], per_step: int, weight: float) -> None:
        kept = [list(t) for t in tokens if len(t) > 1]
        super().__init__([t[:1] for t in kept], [t[1:] for t in kept], per_step, weight)

    def reference(self, backend: TrainerBackend, batch: Batch):
        return backend.reference_logprobs(batch)
