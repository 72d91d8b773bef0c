"""Did the night's last steps overfit? Tonight's held-out corrections, read in the trainer.

The gate judges the final candidate first and, when it passes, used to stop there. But a night
trains a dozen corrections for several visits each, and late in the run it memorizes them: the
held-out corrections (not trained on) read better and better under the checkpoints, then worse.
On three tldr nights whose every checkpoint was kept (embedded 135M, 72 steps, 12 trained
corrections, 4 held out), the mean log-probability gain over the bare base on the held-out
corrections peaked at steps 42 to 54 (1.0 to 1.15 nats a token) and the final read them 0.17 to
0.34 nats a token worse; meanwhile the share of trained corrections whose unlikely tokens were
greedy rose to 0.8. Those finals began 0.75, 1.0 and 0.875 of the scenario's held-out replies
with "TL;DR:", their peak checkpoints 1.0; a fourth night's final (0.48 nats a token) passed
the gate and served the lesson on 3 prompts of 8.

The measure is the parity samples' trainer effect (tuned minus the base alone, per completion
token: `export.trainer_effects`), so it costs a forward pass per sample and candidate and no
export. It reads the personal adapter on the bare base, not stacked on each episode's expert:
a proxy for ranking tonight's candidates against each other, not a gate check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

#: Nats a token by which a back-off candidate must read the held-out corrections better than a
#: final that passed the gate before the night judges the back-off candidates too. The three
#: overfit finals above trailed their best checkpoint by 0.17 to 0.34; neighbouring checkpoints
#: differ by 0.02 to 0.1.
OVERFIT_MARGIN = 0.1


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
        f"the final candidate reads tonight's held-out corrections {others[best] - at_final:.2f} nats a token "
        f"worse than {best} ({at_final:.2f} vs {others[best]:.2f}): it overfit, so the back-off candidates "
        "are judged too"
    )
