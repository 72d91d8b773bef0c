"""Did tonight keep what earlier nights taught? The lesson's own tokens, read teacher-forced.

Earlier nights' held-out corrections are scored token by token (teacher-forced, each under the
expert it was routed to, as served) three ways: under the bare experts, under the deployed
version, and under a candidate. A token the deployed version *taught* is one it made likely
(p >= `TAUGHT_MIN_P`, so greedy decoding picks it) and raised by at least `TAUGHT_MIN_GAIN`
nats over the bare experts: the greeting's first word, the user's city, the lower-case letter.
The gate bounds the mean drop of their probability (`MAX_TAUGHT_DROP`), and below that bound
ranks the passing candidates on reward less the drop (`gate.choice_score`).

Why the gate needs this beside the greedy replies' reward (gate.significantly_worse): a
greeting is 7 characters of a 64-token reply, so chrF barely moves when it goes, and on the 3
or 4 held-out episodes an earlier night leaves, two standard errors let through a night that
lost the greeting on a quarter of the prompts. Teacher-forced probabilities are deterministic
and sit where the lesson is. The limit is a hard floor for heavy forgetting, the ranking the
trade-off below it. Measured on the night-2 candidates of three two-night runs (each scored
afterwards on the scenarios' held-out prompts): greeting then city, 3 held-out episodes and
11 taught tokens: the 6 candidates with drops at most 0.05 kept the greeting on all 8 prompts,
the 5 at 0.06 to 0.12 lost 0 to 2, the 2 at 0.16 lost 2 and 4; bullets then job, 6 taught
tokens: no candidate kept all 8 bullet prompts, drops 0.02 to 0.2 lost 1 and 0.24 to 0.31 lost
3 to 5, so a limit of 0.05 rejected every full-strength candidate and the night taught the job
on 1 prompt of 8, where the candidate the reward ranked first had it on 7. A
measure on so few tokens is coarse: in another greeting run the one candidate lost 0.012 and
still lost the greeting on 1 prompt of 8. Scoring the deployed version's own greedy replies to
everyday questions instead did not separate the candidates (drops 0.09 to 0.27 whether or not
they kept the greeting).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from macaron_local.engine import AdapterHandle, Engine
from macaron_local.learn.episodes import Episode
from macaron_local.learn.loop import completion_tokens

TAUGHT_MIN_P = 0.5
TAUGHT_MIN_GAIN = 1.0  # nats over the bare experts
MAX_TAUGHT_DROP = 0.15  # mean probability a taught token may lose

Stack = Callable[[str], list[AdapterHandle]]
Tokens = tuple[list[int], list[int]]


def correction_tokens(engine: Engine, episodes: Sequence[Episode]) -> list[tuple[str, Tokens]]:
    """(slot, (prompt, completion)) of each episode's correction, as the chat template renders it."""
    return [(e.slot, completion_tokens(engine, e.messages, e.chosen)) for e in episodes if e.chosen]


def logprobs_under(engine: Engine, stack: Stack, samples: Sequence[tuple[str, Tokens]]) -> list[np.ndarray]:
    """Each sample's completion token log-probabilities under its expert's stack."""
    scored = []
    for slot, (prompt, completion) in samples:
        engine.set_adapters(stack(slot))
        scored.append(np.asarray(engine.token_logprobs(prompt, completion), dtype=np.float64))
    engine.set_adapters([])
    return scored


def taught_masks(deployed: Sequence[np.ndarray], bare: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per sample, the tokens the deployed version taught (likely under it, raised over the bare)."""
    return [(d >= np.log(TAUGHT_MIN_P)) & (d - b >= TAUGHT_MIN_GAIN) for d, b in zip(deployed, bare, strict=True)]


@dataclass(frozen=True)
class Retention:
    taught_tokens: int
    mean_drop: float  # mean over taught tokens of max(0, p_deployed - p_candidate)

    @property
    def kept(self) -> bool:
        return self.mean_drop <= MAX_TAUGHT_DROP


def retention(
    candidate: Sequence[np.ndarray], deployed: Sequence[np.ndarray], masks: Sequence[np.ndarray]
) -> Retention:
    """How much probability the taught tokens lost under `candidate` (a pure function of arrays)."""
    drops = [np.maximum(0.0, np.exp(d[m]) - np.exp(c[m])) for c, d, m in zip(candidate, deployed, masks, strict=True)]
    every = np.concatenate(drops) if drops else np.zeros(0)
    return Retention(int(every.size), float(every.mean()) if every.size else 0.0)


class Lessons:
    """Earlier nights' taught tokens, measured once a night; `kept_by` judges each candidate."""

    def __init__(self, engine: Engine, bare: Stack, deployed: Stack, held_old: Sequence[Episode]) -> None:
        self.engine = engine
        self.samples = correction_tokens(engine, held_old)
        self.deployed = logprobs_under(engine, deployed, self.samples)
        self.masks = taught_masks(self.deployed, logprobs_under(engine, bare, self.samples))

    @property
    def taught_tokens(self) -> int:
        return int(sum(m.sum() for m in self.masks))

    def kept_by(self, candidate: Stack) -> Retention:
        return retention(logprobs_under(self.engine, candidate, self.samples), self.deployed, self.masks)
