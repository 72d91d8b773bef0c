"""learn.validation alone (arrays in, verdicts out): a final that overfit its corrections is
looked past, one still learning is not."""

from __future__ import annotations

import numpy as np

from macaron_local.learn.validation import OVERFIT_MARGIN, heldout_gain, overfit

# Held-out corrections' mean gain (nats a token over the bare base) of every candidate kept from
# three real tldr nights (bench/learning.py on the embedded model, stops 34 and 35), read
# teacher-forced under each candidate's GGUF: the final trails the run's best in each.
STOP35_THIRD = {"final": 0.659, "step-66": 0.576, "step-60": 0.819, "step-54": 0.942, "step-48": 0.987,
                "step-42": 0.999, "step-36": 0.979, "step-30": 0.919, "step-24": 0.871}  # fmt: skip
STOP35_SECOND = {"final": 0.755, "step-66": 0.835, "step-60": 0.915, "step-54": 0.977, "step-48": 0.996,
                 "step-42": 1.057}  # fmt: skip
STOP34 = {"final": 0.978, "step-66": 1.035, "step-60": 1.12, "step-54": 1.15}


def test_the_gain_is_the_mean_over_every_token_of_every_sample():
    effects = [np.array([1.0, 3.0]), np.array([-1.0, 1.0, 1.0])]
    assert heldout_gain(effects) == 1.0  # 5 tokens, sum 5: a long sample weighs by its tokens
    assert heldout_gain([]) is None and heldout_gain([np.zeros(0)]) is None


def test_the_recorded_overfit_finals_are_looked_past_and_the_note_names_the_better_checkpoint():
    for gains, best in ((STOP35_THIRD, "step-42"), (STOP35_SECOND, "step-42"), (STOP34, "step-54")):
        note = overfit(gains)
        assert note and best in note and f"{gains[best] - gains['final']:.2f} nats" in note


def test_a_final_still_learning_or_within_the_margin_is_kept_alone():
    rising = {"final": 1.2, "step-66": 1.15, "step-60": 1.0, "final-half": 0.6}
    assert overfit(rising) == ""
    close = {"final": 1.0, "step-66": 1.0 + OVERFIT_MARGIN - 0.01}
    assert overfit(close) == ""
    assert overfit({**close, "step-60": 1.0 + OVERFIT_MARGIN}) != ""


def test_nothing_to_compare_is_no_reason_to_look_further():
    assert overfit({}) == ""
    assert overfit({"final": None, "step-6": 1.0}) == ""  # no held-out correction (a ratings night)
    assert overfit({"final": 0.5}) == ""
    assert overfit({"final": 0.5, "step-6": None}) == ""
