"""Conformance of every trainer backend (torch, mlx) on tiny real models, through the one
interface the learning loop uses: log-probabilities equal the engine's, gradients equal finite
differences, a frozen expert folded into the trainer computes what llama.cpp serves stacked, an
exported adapter passes the parity check that gates deployment (and a stale one fails), and a
step moves the policy toward its target."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from conftest import write_random_adapter
from tinymodels import TinyConfig, build_tiny_model

from macaron_local.adapters import BaseModelInfo, read_adapter
from macaron_local.engine import Engine, EngineConfig
from macaron_local.learn import losses
from macaron_local.learn.backends.base import make_batch
from macaron_local.learn.backends.gguf_weights import frozen_deltas
from macaron_local.learn.export import export_gguf, parity_check, trainer_effects, trainer_logprobs
from macaron_local.learn.run import PARITY_REL_TOLERANCE, PARITY_TOLERANCE

PROMPT, COMPLETION = [0, 5, 17, 33, 9, 9, 41, 2], [12, 60, 7, 1, 25]
# transformers' GGUF loader takes qwen3's head_dim from its own default (128), so the tiny qwen3
# model uses that head size; llama derives it from n_embd / n_head.
CONFIGS = {
    "llama": TinyConfig(arch="llama"),
    "qwen3": TinyConfig(arch="qwen3", n_head=2, n_head_kv=1, head_dim=128),
}
BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in mods), reason=why))
    for name, mods, why in (
        ("torch", ("torch", "peft", "transformers"), "needs the [torch] extra"),
        ("mlx", ("mlx", "mlx_lm"), "needs the [mlx] extra"),
    )
]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("t") / f"{request.param}.gguf", CONFIGS[request.param], seed=5)


def engine_for(model) -> Engine:
    return Engine(EngineConfig(model_path=model.path, n_ctx=64, kv_f32=True, n_threads=2))


def make_backend(name: str, lr: float = 1e-2, float64: bool = False):
    if name == "torch":
        from macaron_local.learn.backends.torch_backend import TorchBackend

        return TorchBackend(lr=lr, threads=2)
    from macaron_local.learn.backends.mlx_backend import MlxBackend

    return MlxBackend(lr=lr, dtype="float64" if float64 else "float32")


def trainer_for(name: str, model, rank: int = 4, expert=None, float64: bool = False):
    backend = make_backend(name, float64=float64)
    backend.load(model.path)
    if float64 and name == "torch":
        _torch_float64(backend)
    if expert is not None:
        backend.fold_in(frozen_deltas(expert, BaseModelInfo.from_gguf(model.path), backend.linear_weight_names()))
    backend.add_lora(rank=rank, alpha=2.0 * rank, seed=1)
    return backend


def _torch_float64(backend) -> None:
    """transformers' RMSNorm computes in float32 whatever the model's dtype, which would drown a
    finite-difference step in rounding: run it in float64 too."""
    backend.model.double()
    for module in backend.model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _float64_rms_norm(module)


def _float64_rms_norm(module):
    import torch

    def forward(hidden):
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        return module.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)

    return forward


def completion_logprobs(backend, lora: bool = True, prompt=PROMPT, completion=COMPLETION) -> np.ndarray:
    batch = make_batch([prompt], [completion])
    values = backend.logprobs(batch) if lora else backend.reference_logprobs(batch)
    return backend.to_numpy(values)[0][np.asarray(batch.mask[0]) > 0]


def randomize_lora_b(backend, scale: float = 0.3, seed: int = 7) -> None:
    """B starts at zero (no effect); give it values so the adapter changes something."""
    rng = np.random.default_rng(seed)
    for name, values in backend.lora_weights().items():
        if name.endswith("lora_B"):
            backend.set_lora_weight(name, rng.normal(0, scale, values.shape))


def sft_objective(logp, reference, mask):
    return losses.sft_loss(logp, mask), {}


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_trainer_logprobs_equal_the_engine(backend_name, tiny):
    backend = trainer_for(backend_name, tiny)
    with engine_for(tiny) as engine:
        expected = engine.token_logprobs(PROMPT, COMPLETION)
    assert np.abs(completion_logprobs(backend) - expected).max() <= 1e-4  # B = 0: the base model
    assert np.abs(completion_logprobs(backend, lora=False) - expected).max() <= 1e-4


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_gradients_match_finite_differences(backend_name, tiny):
    """Central differences in float64 on randomly chosen LoRA entries (A and B). MLX's fused
    kernels (rms_norm, rope) compute in float32 even for float64 inputs, so its step is larger and
    its tolerance wider; a wrong gradient (a sign, a missing scale, a dropped term) fails both."""
    eps, abs_tol, rel_tol = (1e-6, 1e-7, 1e-4) if backend_name == "torch" else (1e-2, 2e-5, 2e-3)
    backend = trainer_for(backend_name, tiny, float64=True)
    randomize_lora_b(backend, 0.1)
    batch = make_batch([PROMPT], [COMPLETION])

    def loss() -> float:
        return float(backend.to_numpy(sft_objective(backend.logprobs(batch), None, backend.mask(batch))[0]))

    grads = backend.gradients(batch, sft_objective)
    weights = backend.lora_weights()
    assert set(grads) == set(weights) and len(weights) >= 2 * 7  # every linear layer has A and B
    rng = np.random.default_rng(0)
    names = sorted(weights)
    for name in [names[i] for i in rng.choice(len(names), 6, replace=False)]:
        values = weights[name].copy()
        index = tuple(int(rng.integers(0, d)) for d in values.shape)
        original = values[index]
        values[index] = original + eps
        backend.set_lora_weight(name, values)
        up = loss()
        values[index] = original - eps
        backend.set_lora_weight(name, values)
        down = loss()
        values[index] = original
        backend.set_lora_weight(name, values)
        numeric = (up - down) / (2 * eps)
        analytic = grads[name][index]
        assert abs(analytic - numeric) <= abs_tol + rel_tol * abs(numeric), (name, analytic, numeric)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_folded_expert_computes_what_the_engine_serves_stacked(backend_name, tiny, tmp_path):
    """The personal adapter trains on top of the frozen expert: the trainer's reference (LoRA off)
    must be base + expert exactly as llama.cpp serves it."""
    expert = write_random_adapter(tmp_path / "expert.gguf", tiny, 3, seed=11)
    backend = trainer_for(backend_name, tiny, expert=expert)
    with engine_for(tiny) as engine:
        plain = engine.token_logprobs(PROMPT, COMPLETION)
        engine.set_adapters([engine.load_adapter(expert)])
        stacked = engine.token_logprobs(PROMPT, COMPLETION)
    assert np.abs(stacked - plain).max() > 0.05  # the expert changes something
    assert np.abs(completion_logprobs(backend, lora=False) - stacked).max() <= 1e-4


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_exported_adapter_passes_parity_and_a_stale_one_fails(backend_name, tiny, tmp_path):
    backend = trainer_for(backend_name, tiny)
    randomize_lora_b(backend)
    base = BaseModelInfo.from_gguf(tiny.path)
    adapter = export_gguf(backend, base, tmp_path / "personal.gguf", task_name="L0 Chat")
    assert read_adapter(adapter).ranks == {4}
    assert np.abs(completion_logprobs(backend) - completion_logprobs(backend, lora=False)).max() > 0.05
    samples = [(PROMPT, COMPLETION), ([1, 2, 3], [4, 5, 6, 7])]
    with engine_for(tiny) as engine:
        report = parity_check(engine, adapter, backend, samples, tolerance=1e-4)
        assert report.ok, report.summary()
        assert engine.active == ()  # the engine's own adapter set is restored
        randomize_lora_b(backend, 0.5, seed=8)  # the trainer moves on: the old export no longer matches
        stale = parity_check(engine, adapter, backend, samples, tolerance=1e-4)
    assert not stale.ok and "FAILED" in stale.summary()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_the_shipped_parity_rule_still_catches_a_stale_export_of_a_strong_adapter(backend_name, tiny, tmp_path):
    """The shipped rule lets a token differ by a share of its own effect (quantization's residual
    grows with it); an export of other weights of the same strength must still fail."""
    backend = trainer_for(backend_name, tiny)
    randomize_lora_b(backend, 8.0, seed=3)
    base = BaseModelInfo.from_gguf(tiny.path)
    adapter = export_gguf(backend, base, tmp_path / "personal.gguf", task_name="L0 Chat")
    assert np.abs(completion_logprobs(backend) - completion_logprobs(backend, lora=False)).max() > 2.0  # strong
    samples = [(PROMPT, COMPLETION), ([1, 2, 3], [4, 5, 6, 7])]
    with engine_for(tiny) as engine:
        right = parity_check(engine, adapter, backend, samples, PARITY_TOLERANCE, PARITY_REL_TOLERANCE)
        randomize_lora_b(backend, 8.0, seed=4)
        stale = parity_check(engine, adapter, backend, samples, PARITY_TOLERANCE, PARITY_REL_TOLERANCE)
    assert right.ok, right.summary()
    assert not stale.ok and "+ 0.25 x the token's effect" in stale.summary()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_step_moves_the_policy_toward_the_target(backend_name, tiny):
    backend = trainer_for(backend_name, tiny)
    batch = make_batch([PROMPT, [3, 4]], [COMPLETION, [8, 9, 10]])
    before = completion_logprobs(backend).sum()
    outcomes = [backend.train_step(batch, sft_objective, with_reference=False) for _ in range(5)]
    assert completion_logprobs(backend).sum() > before + 0.1
    assert outcomes[-1].loss < outcomes[0].loss and all(o.grad_norm > 0 for o in outcomes)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_batch_of_mixed_lengths_scores_each_row_as_it_scores_alone(backend_name, tiny):
    """Both backends run rows in sub-batches cut to their own length: the numbers (and the
    gradient) must be those of each row alone."""
    backend = trainer_for(backend_name, tiny, float64=True)
    randomize_lora_b(backend)
    rows = [(PROMPT, COMPLETION), ([3, 4], [8, 9]), ([3], list(range(8, 21))), ([7, 7], [1])]
    batch = make_batch([p for p, _ in rows], [c for _, c in rows])
    together = backend.to_numpy(backend.logprobs(batch))
    for index, (prompt, completion) in enumerate(rows):
        alone = completion_logprobs(backend, prompt=prompt, completion=completion)
        assert np.abs(together[index][np.asarray(batch.mask[index]) > 0] - alone).max() <= 1e-9
    grads = backend.gradients(batch, sft_objective)
    one_by_one = [backend.gradients(make_batch([p], [c]), sft_objective) for p, c in rows]
    weights = [len(c) / sum(len(c) for _, c in rows) for _, c in rows]  # sft is a token mean
    for name, value in grads.items():
        combined = sum(w * g[name] for w, g in zip(weights, one_by_one, strict=True))
        assert np.abs(value - combined).max() <= 1e-6 * max(1.0, np.abs(value).max())


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_effects_from_a_reference_read_once_equal_effects_read_afresh(backend_name, tiny):
    """The sequential night reads the samples without the LoRA once and reuses that for every
    candidate it exports: the effects must be those read afresh, for each candidate's weights."""
    backend = trainer_for(backend_name, tiny)
    samples = [(PROMPT, COMPLETION), ([1, 2, 3], [4, 5, 6, 7])]
    unadapted = trainer_logprobs(backend, samples, reference=True)
    for seed in (3, 4):
        randomize_lora_b(backend, 0.5, seed=seed)
        reused, fresh = trainer_effects(backend, samples, unadapted), trainer_effects(backend, samples)
        assert max(np.abs(r - f).max() for r, f in zip(reused, fresh, strict=True)) <= 1e-6
        assert max(np.abs(f).max() for f in fresh) > 0.05  # the LoRA moved them: not equal by being zero


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_step_whose_loss_is_not_finite_is_skipped_and_the_lora_stays_finite(backend_name, tiny):
    """A NaN step (a ratings night at stop 40 wrote one into the LoRA, and its export was
    refused) is not applied: the weights stay as they were, and the next finite step trains."""
    backend = trainer_for(backend_name, tiny)
    randomize_lora_b(backend)
    batch = make_batch([PROMPT, [3, 4]], [COMPLETION, [8, 9, 10]])
    before = backend.lora_weights()

    def poisoned(logp, reference, mask):
        loss, parts = sft_objective(logp, reference, mask)
        return loss * float("nan"), parts

    outcome = backend.train_step(batch, poisoned, with_reference=False)
    assert not np.isfinite(outcome.loss)
    after = backend.lora_weights()
    assert all(np.array_equal(before[name], after[name]) for name in before)
    good = backend.train_step(batch, sft_objective, with_reference=False)
    assert np.isfinite(good.loss) and np.isfinite(good.grad_norm)
    assert all(np.isfinite(values).all() for values in backend.lora_weights().values())
    assert any(not np.array_equal(before[name], values) for name, values in backend.lora_weights().items())
