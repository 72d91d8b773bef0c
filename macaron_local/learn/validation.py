"""Which candidates generalize? Tonight's held-out corrections, read in the trainer.

A night trains a dozen corrections for several visits each, and late in the run it memorizes
them: the held-out corrections (never trained on) read better under each checkpoint, then
worse. On four tldr nights whose candidates were all kept (embedded 135M, 72 steps, 12 trained
corrections, 4 held out) the mean log-probability gain over the bare base on the held-out
corrections peaked at steps 30 to 54 (1.0 to 1.15 nats a token), and the final read them 0.17
to 0.38 nats a token worse, while the trained corrections' unlikely tokens went on becoming
greedy (a quarter at step 24, four fifths at the end). Three of those finals began 0.75, 1.0
and 0.875 of the scenario's held-out replies with "TL;DR:", their best-reading checkpoints
1.0. A fifth tldr night's final (0.48 nats a token) passed the gate and served the lesson on
3 prompts of 8; replayed from its store with `overfit`, the same night deployed step 30 and
served it on 8 of 8. A sixth read best at step 36 (0.86) and ended at 0.35; a jobfact night
(54 steps) read best at step 42 (1.55) and ended at 1.14; the two nights of a bullets-then-
jobfact run, 1.40 against 1.13 and 1.26 against 1.14.

So the gate uses the reading twice (`run._gate_and_record`):
- a final that passed is looked past when another candidate reads the held-out corrections at
  least `OVERFIT_MARGIN` better (`overfit`): the back-off candidates are judged too, and the
  best that passes is deployed, as after a rejected final;
- the back-off judges its candidates best reader first (`ranked`), not newest first: on three
  recorded scans it kept each choice in 5, 9 and 4 judgements where newest first took 10, 11
  and 8 (tests/test_validation.py).
The gate's checks still decide: the reading is the held-out corrections' likelihood, which the
greedy replies it serves need not follow (one checkpoint read best and began half its replies
with the prefix).

Training can stop once the reading has clearly fallen (`EarlyStop`, `[learn]
early_stop_patience`, off by default). Stopped `patience` (3) checkpoints past the best reader
and `OVERFIT_MARGIN` below it, four nights above would have kept every candidate the gate went
on to choose (steps 30 to 42) and stopped 12 to 24 steps sooner on the 72-step ones; a tldr
night run with it stopped at step 60 of 72 and served 1.0 (457 s of learning against 547 to
651). But the reading is no measure of the lesson itself: a mixedbrief night (short answers in
another voice) read its held-out corrections best at step 18 (0.32) and its final at -0.25,
and that final passed the gate and served 0.75. Stopped at step 36 (by patience alone, the
rule first tried), none of the night's 7 candidates passed; the margin would have stopped it
at step 42, which was never judged. So the reading orders and triggers the back-off, where the
gate still judges every candidate, and it ends training only where the user asks.

The reading is the held-out corrections' trainer effect (tuned minus the base alone, per
completion token, as `export.trainer_effects`; at most 4 corrections), a forward pass per
correction and candidate, no export, taken at each checkpoint while training. It
reads the personal adapter on the bare base, not stacked on each episode's expert: a proxy to
rank tonight's candidates against each other, not a check. Only corrections are read (the
user's own words, `Episode.corrected`), not the liked replies of a ratings night (up-votes, the
liked side of pairs): the model sampled those itself, and they read lower as training sharpens
the policy whatever it learns. A noapology ratings night read them 0.02 nats a token above the
base at step 6 and -0.80 at its final, which served 1.0; the overfit look judged three early
checkpoints for nothing (all failed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np

from macaron_local.learn.backends.base import TrainerBackend
from macaron_local.learn.export import trainer_logprobs

Samples = Sequence[tuple[Sequence[int], Sequence[int]]]

#: Nats a token by which a back-off candidate must read the held-out corrections better than a
#: final that passed the gate before the night judges the back-off candidates too (the default
#: of `[learn] overfit_margin`). The nine finals above trailed their best reader by 0.12 to
#: 0.6. Below the margin the final is kept alone, as before: judging three candidates more
#: costs some 40 s on the embedded model, and a reading of 4 corrections cannot rank
#: candidates that close.
OVERFIT_MARGIN = 0.1


class Named(Protocol):
    name: str


N = TypeVar("N", bound=Named)


def heldout_gain(effects: Sequence[np.ndarray]) -> float | None:
    """Mean log-probability gain per token over the held-out corrections' tokens (None: none)."""
    tokens = np.concatenate([np.asarray(e, dtype=np.float64) for e in effects]) if effects else np.zeros(0)
    return float(tokens.mean()) if tokens.size else None


def overfit(gains: Mapping[str, float | None], final: str = "final", margin: float = OVERFIT_MARGIN) -> str:
    """Why the night should look past a final that passed ("" when it should not): some other
    candidate reads tonight's held-out corrections at least `margin` nats a token better."""
    at_final = gains.get(final)
    others = {name: g for name, g in gains.items() if name != final and g is not None}
    if at_final is None or not others:
        return ""
    best = max(others, key=others.__getitem__)
    if others[best] < at_final + margin:
        return ""
    return (
        f"the {final} candidate reads tonight's held-out corrections {others[best] - at_final:.2f} nats a token "
        f"worse than {best} ({at_final:.2f} vs {others[best]:.2f}): it overfit, so the back-off candidates "
        "are judged too"
    )


def ranked(candidates: Sequence[N], gains: Mapping[str, float | None], margin: float = OVERFIT_MARGIN) -> list[N]:
    """The order the back-off judges `candidates` in: the best reader of tonight's held-out
    corrections first. Those without a gain (no held-out correction, a remote trainer) follow
    in the order given, which is then the run's own: newest checkpoint first.
    Readings that span less than `margin` give no order at all (the run's is kept): a reading
    of 4 corrections cannot rank candidates that close."""
    read = [g for c in candidates if (g := gains.get(c.name)) is not None]
    if not read or max(read) - min(read) < margin:
        return list(candidates)

    def key(candidate: N) -> float:
        gain = gains.get(candidate.name)
        return -gain if gain is not None else math.inf

    return sorted(candidates, key=key)


@dataclass
class EarlyStop:
    """Whether training should stop, from the held-out reading at each checkpoint: once
    `patience` checkpoints in a row read no better than the best so far and the latest reads at
    least `margin` below it (the night has overfit by `overfit`'s own measure). `patience` 0:
    never. The margin keeps a noisy plateau going: a mixedbrief night read 0.32 at step 18 and
    0.23 to 0.29 at the next three. A checkpoint with no reading (a night without held-out
    corrections) never stops it. `readings` keeps each step's reading, so the gate need not
    read those candidates again."""

    patience: int
    margin: float = OVERFIT_MARGIN
    readings: dict[int, float] = field(default_factory=dict)
    best_step: int | None = None
    since_best: int = 0

    def update(self, step: int, gain: float | None) -> bool:
        """Record the reading after `step` steps; True when training should stop there."""
        if gain is None:
            return False
        self.readings[step] = gain
        if self.best_step is None or gain > self.readings[self.best_step]:
            self.best_step, self.since_best = step, 0
            return False
        self.since_best += 1
        fallen = self.readings[self.best_step] - gain >= self.margin
        return bool(self.patience) and self.since_best >= self.patience and fallen

    def note(self, stopped_at: int, planned: int) -> str:
        """Why training stopped at `stopped_at` of `planned` steps, for the run's record."""
        assert self.best_step is not None
        best, now = self.readings[self.best_step], self.readings[stopped_at]
        return (
            f"stopped at step {stopped_at} of {planned}: tonight's held-out corrections read best at step "
            f"{self.best_step} ({best:.2f} nats a token), no better in the {self.since_best} "
            f"checkpoint{'' if self.since_best == 1 else 's'} since, and {best - now:.2f} worse now"
        )


class HeldoutReader:
    """Tonight's held-out corrections (`samples`, prompt and completion tokens) read under the
    trainer's LoRA as it is now: at each checkpoint while training (`at_checkpoint`, which
    stops it early) and for each candidate after. `bare()` puts the trainer on the bare base
    first (unfolding an expert), as the reading is taken; the base alone is read once, here."""

    def __init__(self, backend: TrainerBackend, samples: Samples, bare: Callable[[], object], stop: EarlyStop) -> None:
        self.backend, self.samples, self.bare, self.stop = backend, list(samples), bare, stop
        bare()
        self.reference = trainer_logprobs(backend, self.samples, reference=True)

    def read(self) -> float | None:
        """The LoRA's gain on the held-out corrections now (None: there are none)."""
        if not self.samples:
            return None
        self.bare()
        tuned = trainer_logprobs(self.backend, self.samples)
        return heldout_gain([t - r for t, r in zip(tuned, self.reference, strict=True)])

    def at_checkpoint(self, step: int) -> bool:
        """Read the checkpoint after `step` steps; True when training should stop there."""
        return self.stop.update(step, self.read())

    def known(self, name: str, step: int, scale: float) -> float | None:
        """The reading taken while training of a candidate at full strength (`step-N`, or the
        final where training stopped at a checkpoint); None where there is none."""
        if scale != 1.0 or name not in (f"step-{step}", "final"):
            return None
        return self.stop.readings.get(step)

    def reading(self, name: str, step: int, scale: float, load: Callable[[], object]) -> float | None:
        """A candidate's reading: the one taken while training where there is one (`known`),
        else `load()` (which puts its weights on the trainer) and read it now."""
        known = self.known(name, step, scale)
        if known is not None:
            return known
        load()
        return self.read()
