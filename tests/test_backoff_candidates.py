"""The back-off's candidates, alone (no model): the half-strength one halves tonight's update and
never what earlier nights taught, and the deployed candidate is chosen on all held-out feedback."""

from __future__ import annotations

import numpy as np

from macaron_local.learn.gate import Scores
from macaron_local.learn.loop import Checkpoint, LearnConfig, TrainResult
from macaron_local.learn.run import Candidate, _fallbacks


def lora(a: float, b: float, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "q.lora_A": (a * rng.standard_normal((4, 16))).astype(np.float32),
        "q.lora_B": (b * rng.standard_normal((16, 4))).astype(np.float32),
    }


def update(weights: dict[str, np.ndarray]) -> np.ndarray:
    return weights["q.lora_B"] @ weights["q.lora_A"]


def test_from_zero_the_half_candidate_is_exactly_half_the_update():
    start = lora(1.0, 0.0)  # a fresh LoRA: B is zero, so it serves nothing yet
    end = lora(1.0, 1.0, seed=1)
    half = Candidate("final-half", 10, 5e-4, 0.1, end, 0.5, origin=start).served_weights()
    np.testing.assert_allclose(update(half), 0.5 * update(end), rtol=1e-6)
    np.testing.assert_array_equal(half["q.lora_A"], end["q.lora_A"])
    # No origin recorded (the remote trainer's case) reads the same way.
    np.testing.assert_allclose(update(Candidate("h", 10, 0, 0, end, 0.5).served_weights()), update(half))


def test_after_a_warm_start_the_half_candidate_keeps_what_earlier_nights_taught():
    night1 = lora(1.0, 1.0, seed=2)  # the deployed version tonight started from
    night2 = {k: v + 0.1 * lora(1.0, 1.0, seed=3)[k] for k, v in night1.items()}
    half = Candidate("final-half", 66, 5e-4, 0.1, night2, 0.5, origin=night1).served_weights()
    for name in night1:  # halfway along tonight's path in weight space
        np.testing.assert_allclose(half[name], (night1[name] + night2[name]) / 2, rtol=1e-6, atol=1e-7)
    # Scaling the whole adapter (the old rule) would have halved night 1's update too:
    night1_kept = np.linalg.norm(update(half) - update(night1)) / np.linalg.norm(update(night1))
    whole_half = np.linalg.norm(0.5 * update(night2) - update(night1)) / np.linalg.norm(update(night1))
    assert night1_kept < 0.1 < 0.4 < whole_half


def test_full_strength_candidates_serve_their_weights_unchanged():
    end = lora(1.0, 1.0, seed=4)
    assert Candidate("final", 10, 5e-4, 0.1, end, origin=lora(1.0, 1.0)).served_weights() is end


def test_the_fallbacks_halve_from_where_the_run_started():
    start, end = lora(1.0, 1.0, seed=5), lora(1.0, 1.0, seed=6)
    result = TrainResult(checkpoints=[Checkpoint(6, lora(1.0, 1.0, seed=7)), Checkpoint(12, end)], start=start)
    final = Candidate("final", 18, 5e-4, 0.1, end)
    names = [c.name for c in _fallbacks(result, final, LearnConfig())]
    assert names == ["step-12", "step-6", "final-half"]
    half = _fallbacks(result, final, LearnConfig())[-1]
    assert half.origin is start and half.scale == 0.5


def test_a_candidate_is_chosen_on_every_held_out_episode_pooled():
    forgets = Scores(held_new=[0.6, 0.6], held_old=[-0.5, -0.5, -0.5, -0.5])
    keeps = Scores(held_new=[0.4, 0.4], held_old=[0.3, 0.3, 0.3, 0.3])
    assert forgets.new_mean > keeps.new_mean
    assert keeps.all_mean > forgets.all_mean
    assert abs(keeps.all_mean - (0.8 + 1.2) / 6) < 1e-9
    assert Scores([], []).all_mean == 0.0
