"""The night's late checkpoints averaged: the candidate the gate judges first.

A night steps on two episodes at a time with two samples each, so its LoRA wanders: on
recorded twelvewords nights (a twelve-word limit, embedded 135M) the checkpoints of one run
served the limit on 0.25 to 1.0 of the scenario's unseen prompts, and which of them the gate
chose, on three held-out episodes, was close to a coin toss (deployed: 0.375 to 0.875).
Averaging the weights along the end of a run (stochastic weight averaging, Izmailov et al.
2018; latest weight averaging, Kaddour 2022) keeps what the checkpoints share and cancels
much of how each one wandered. Replayed offline on 13 recorded nights (docs, stop 43), the
mean of the judged checkpoints in a run's second half and its final served the scenario's check
better than what the night deployed on 8, level on 3 and worse on 2 (mean 0.856 against 0.712;
twelvewords 0.625 to 1.0 where the nights deployed 0.375 to 0.875). The mean of the whole run
did worse on facts (jobfact 0.625, allergy 0.5 against 0.875 and 0.625 deployed): its early
checkpoints had not learned them yet, so only the second half is averaged.

The factors A and B are averaged each, as SWA averages any parameters; the product of the
means is not the mean of the products, but every member lies on one path from one start, and
the gate judges the result like any other candidate (parity included, on the exported file).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the loop's LearnConfig takes its default share from here
    from macaron_local.learn.loop import Checkpoint

#: The share of the run, counted back from its end, whose checkpoints are averaged with the
#: final (the default of `[learn] average_share`; 0: no average, the final is judged first).
AVERAGE_SHARE = 0.5


def tail_members(checkpoints: Sequence[Checkpoint], final_step: int, share: float) -> list[int]:
    """The steps averaged: every checkpoint within the last `share` of `final_step` steps,
    then the final itself; only the final (nothing to average) when `share` is 0 or no
    checkpoint lies that late."""
    if share <= 0:
        return [final_step]
    since = final_step * (1.0 - share)
    return [c.step for c in checkpoints if since <= c.step < final_step] + [final_step]


def tail_average(
    checkpoints: Sequence[Checkpoint], final_step: int, final: Mapping[str, np.ndarray], share: float = AVERAGE_SHARE
) -> tuple[dict[str, np.ndarray], list[int]] | None:
    """(the mean, tensor by tensor, of the LoRA weights at `tail_members`, those steps), or
    None when the final would be averaged with nothing. Summed in float64, kept in each
    tensor's own dtype."""
    steps = tail_members(checkpoints, final_step, share)
    if len(steps) < 2:
        return None
    by_step = {c.step: c.weights for c in checkpoints} | {final_step: final}
    members = [by_step[step] for step in steps]
    averaged = {}
    for name, last in final.items():
        total = np.zeros(last.shape, dtype=np.float64)
        for weights in members:
            total += weights[name]
        averaged[name] = (total / len(members)).astype(last.dtype)
    return averaged, steps
