"""What the bare experts know, held token by token on the night's anchor answers.

An anchor (learn/anchors.py) is rewarded when a sampled reply keeps the content of the bare
experts' answer (`rewards.content_kept`). That reward only speaks once a sample has already lost
the content, and at temperature 0.9 two samples a group rarely show a fact going wrong before it
has gone. Measured on the embedded model, long nights (three lessons, 96 to 108 steps) drifted
in what the model knows with no lesson anywhere in the answer: "The capital of Germany is
Lübeck.", "A week is 31 days" (stop 50). The gate caught those candidates, and the back-off then
deployed an earlier checkpoint that had taught less.

So each step can also score `per_step` anchor answers as guarded rows (learn/guards.py) and hold
their tokens one-sided to the bare experts (`losses.excess_nll`), as the passages hold plain
text. The hold is on the distribution at each token, not on a sample, so it pushes back as soon
as the probability of "Berlin" starts to fall, long before a sample says "Lübeck".

Which tokens are held: the answer's first sentence (the part an anchor's reward reads), with the
styles tonight's corrections keep adding (learn/compose.py) applied, so a closing line or lower
case taught tonight is not opposed; of it, only the tokens the bare experts are sure of
(probability at least `KNOWN_MIN_P`): the facts, not the phrasing. The first token is never
held: a reply's opening is where labels and formats ("TL;DR:", "- ", a greeting) go, and those
lessons must be free to take it.

It is off by default (`LearnConfig.anchor_hold_weight` 0). On five nights of three lessons
each (stop 51), the candidates it trained kept their factual answers: 25 of 29 passed the
gate's factual check, where the JSON trio's back-off had seen 9 of 12 fail. But no lesson
reached more of its held-out prompts, and a night took up to 60 s longer. What kept those
nights from their targets was a lesson that had not formed, not knowledge lost on the way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from macaron_local.engine import Engine
from macaron_local.learn.backends.base import Batch, TrainerBackend
from macaron_local.learn.compose import Style, styled
from macaron_local.learn.episodes import Episode
from macaron_local.learn.guards import RowGuard
from macaron_local.learn.loop import completion_tokens
from macaron_local.learn.retention import Stack, logprobs_under
from macaron_local.learn.rewards import first_sentence

#: A token is held when the bare experts give it at least this probability.
KNOWN_MIN_P = 0.5


class AnchorHold(RowGuard):
    """Anchor answers as guarded rows, their known tokens held to the bare experts (LoRA off)."""

    name = "anchor_hold"

    def reference(self, backend: TrainerBackend, batch: Batch):
        return backend.reference_logprobs(batch)


def held_text(answer: str, styles: Sequence[Style]) -> str:
    """The first sentence of a bare answer, with tonight's styles applied where it lacks them."""
    text = first_sentence(answer)
    return styled(text, styles) if text else text


def known_mask(bare_logprobs: np.ndarray, text_tokens: int) -> np.ndarray:
    """True on the tokens of the text (its first `text_tokens`, not the template's end of turn
    after them) the bare experts are sure of, never on the first (a pure function). The end of
    turn is left free: where a reply stops is a length or a closing line the user may teach."""
    mask = bare_logprobs >= np.log(KNOWN_MIN_P)
    mask[:1] = False
    mask[text_tokens:] = False
    return mask


def anchor_hold(
    engine: Engine,
    anchors: Sequence[Episode],
    styles: Sequence[Style],
    bare: Stack,
    group_of: Callable[[Episode], str],
    per_step: int,
    weight: float,
) -> AnchorHold:
    """The guard for tonight's answered anchors; an anchor with no known token is left out."""
    if weight <= 0 or per_step <= 0:
        return AnchorHold([], [], 0, 0.0)
    answered = [(a, text) for a in anchors if (text := held_text(a.chosen or "", styles))]
    samples = [(a.slot, completion_tokens(engine, a.messages, text)) for a, text in answered]
    lengths = [len(engine.tokenize(text, add_bos=False, special=False)) for _, text in answered]
    bare_logprobs = logprobs_under(engine, bare, samples)
    masks = [known_mask(b, n) for b, n in zip(bare_logprobs, lengths, strict=True)]
    kept = [(group_of(a), p, c, m) for (a, _), (_, (p, c)), m in zip(answered, samples, masks, strict=True) if m.any()]
    return AnchorHold.from_masked(kept, per_step, weight)
