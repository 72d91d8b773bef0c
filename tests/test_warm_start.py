"""A night continues the deployed version (learn/warm.py) on a real trainer and a tiny model:
at the same rank, and widened from a lower rank of the same scale (a user's versions from before
a rank change), it starts out serving exactly what was deployed; a different scale or a higher
rank starts from zero and says so."""

from __future__ import annotations

import numpy as np
import pytest
from test_trainer_backends import BACKENDS, CONFIGS, completion_logprobs, randomize_lora_b, trainer_for
from tinymodels import build_tiny_model

from macaron_local.adapters import BaseModelInfo, read_adapter
from macaron_local.learn.export import export_gguf
from macaron_local.learn.warm import warm_start, widened


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("w") / "llama.gguf", CONFIGS["llama"], seed=5)


@pytest.fixture
def deployed(tiny, tmp_path):
    """A rank-4, alpha-8 personal adapter (scale 2) that changes what the model says."""
    backend = trainer_for("torch", tiny, rank=4)
    randomize_lora_b(backend)
    path = export_gguf(backend, BaseModelInfo.from_gguf(tiny.path), tmp_path / "deployed.gguf", task_name="L0 Chat")
    assert read_adapter(path).ranks == {4}
    return path, completion_logprobs(backend), completion_logprobs(backend, lora=False)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("rank", [4, 8])
def test_a_continued_night_starts_out_serving_the_deployed_version(backend_name, rank, tiny, deployed):
    path, served, bare = deployed
    backend = trainer_for(backend_name, tiny, rank=rank)  # alpha 2 * rank: the same scale
    note = warm_start(backend, path, BaseModelInfo.from_gguf(tiny.path), rank, 2.0 * rank)
    assert note.startswith("continued from the deployed version")
    assert ("widened to 8" in note) == (rank == 8)
    assert np.abs(served - bare).max() > 0.05  # the deployed version changes something
    np.testing.assert_allclose(completion_logprobs(backend), served, atol=1e-4)
    if rank == 8:  # the new directions are live: fresh A rows, zero B columns
        weights = backend.lora_weights()
        a = next(v for k, v in weights.items() if k.endswith("lora_A"))
        b = next(v for k, v in weights.items() if k.endswith("lora_B"))
        a, b = (a, b) if a.shape[0] == 8 else (a.T, b.T)
        assert np.abs(a[4:]).max() > 0 and np.abs(b[:, 4:]).max() == 0


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(("rank", "alpha", "why"), [(8, 8.0, "alpha 8"), (2, 4.0, "the trainer 2")])
def test_another_scale_or_a_lower_trainer_rank_starts_from_zero(backend_name, rank, alpha, why, tiny, deployed):
    path, _, bare = deployed
    backend = trainer_for(backend_name, tiny, rank=rank)
    note = warm_start(backend, path, BaseModelInfo.from_gguf(tiny.path), rank, alpha)
    assert note.startswith("started from zero") and why in note
    np.testing.assert_allclose(completion_logprobs(backend), bare, atol=1e-6)  # B is still zero


def test_widening_keeps_the_product_in_either_orientation():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 6)), rng.standard_normal((5, 4))
    fresh_a, fresh_b = rng.standard_normal((8, 6)), np.zeros((5, 8))
    wide_a, wide_b = widened("q.lora_A", a, fresh_a, 8, False), widened("q.lora_B", b, fresh_b, 8, False)
    np.testing.assert_allclose(wide_b @ wide_a, b @ a)
    np.testing.assert_array_equal(wide_a[4:], fresh_a[4:])
    mlx_a, mlx_b = widened("q.lora_A", a, fresh_a.T, 8, True), widened("q.lora_B", b, fresh_b.T, 8, True)
    np.testing.assert_array_equal(mlx_a, wide_a.T)
    np.testing.assert_array_equal(mlx_b, wide_b.T)
    square = rng.standard_normal((4, 4))  # rank 4 on a 4-wide layer: the shape cannot tell the layout
    np.testing.assert_array_equal(widened("g.lora_B", square, np.zeros((4, 4)), 4, True), square.T)
    np.testing.assert_array_equal(widened("g.lora_B", square, np.zeros((4, 4)), 4, False), square)
