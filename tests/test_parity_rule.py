"""The parity rule alone, on arrays: a token's effect in llama.cpp may differ from the trainer's by
a floor plus a share of the effect (quantization's residual grows with it), and no more. The
figures below are the shape measured on the embedded model (largest residuals 0.7 to 0.95 nats
on tokens moved 5 to 8 nats); the real engine and trainer are in test_trainer_backends.py."""

from __future__ import annotations

import numpy as np

from macaron_local.learn.export import judge_parity


def effects(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 3, 40), rng.normal(0, 1, 30)]


def test_a_residual_that_grows_with_the_effect_passes_with_a_share_but_not_without():
    trainer = effects()
    trainer[0][3] = 8.0  # a token the adapter moved far
    engine = [t.copy() for t in trainer]
    engine[0][3] = 6.9  # 1.1 nats off: 14% of its effect
    assert not judge_parity(engine, trainer, 1.0).ok  # the old fixed limit
    shared = judge_parity(engine, trainer, 1.0, 0.25)
    assert shared.ok and abs(shared.max_abs_diff - 1.1) < 1e-9
    assert 1.1 - 0.25 * 8.0 - 1e-9 <= shared.max_excess <= 0.0  # the other tokens match exactly


def test_a_token_the_adapter_barely_moved_gets_only_the_floor():
    trainer = effects()
    trainer[1][5] = 0.1
    engine = [t.copy() for t in trainer]
    engine[1][5] = 1.3  # a 1.2-nat change the trainer never made
    report = judge_parity(engine, trainer, 1.0, 0.25)
    assert not report.ok and "FAILED" in report.summary()


def test_a_wrong_scale_or_a_stale_export_fails():
    trainer = effects(1)
    trainer[0][0] = 6.0  # at least one strong token, as a trained night has
    assert not judge_parity([2.0 * t for t in trainer], trainer, 1.0, 0.25).ok
    assert not judge_parity([0.5 * t for t in trainer], trainer, 1.0, 0.25).ok
    assert not judge_parity([np.zeros_like(t) for t in trainer], trainer, 1.0, 0.25).ok  # nothing applied
    assert judge_parity([t + 0.05 for t in trainer], trainer, 1.0, 0.25).ok


def test_no_tokens_is_a_pass_with_zero_figures():
    report = judge_parity([], [], 1.0, 0.25)
    assert report.ok and report.n_tokens == 0 and report.max_abs_diff == 0.0
