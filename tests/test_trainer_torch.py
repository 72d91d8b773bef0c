"""Conformance of the torch trainer backend on tiny real models: its log-probabilities equal the
engine's, its gradients equal finite differences, and an exported adapter computes in llama.cpp
exactly what the trainer computes (the parity check that gates deployment)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from tinymodels import TinyConfig, build_tiny_model  # noqa: E402

from macaron_local.adapters import BaseModelInfo, read_adapter  # noqa: E402
from macaron_local.engine import Engine, EngineConfig  # noqa: E402
from macaron_local.learn.backends.base import make_batch  # noqa: E402
from macaron_local.learn.backends.torch_backend import TorchBackend  # noqa: E402
from macaron_local.learn.export import export_gguf, parity_check  # noqa: E402

EPS = 1e-6
PROMPT, COMPLETION = [0, 5, 17, 33, 9, 9, 41, 2], [12, 60, 7, 1, 25]
# transformers' GGUF loader takes qwen3's head_dim from its own default (128), so the tiny qwen3
# model uses that head size; llama derives it from n_embd / n_head.
CONFIGS = {
    "llama": TinyConfig(arch="llama"),
    "qwen3": TinyConfig(arch="qwen3", n_head=2, n_head_kv=1, head_dim=128),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("t") / f"{request.param}.gguf", CONFIGS[request.param], seed=5)


def engine_for(model) -> Engine:
    return Engine(EngineConfig(model_path=model.path, n_ctx=64, kv_f32=True, n_threads=2))


def trainer_for(model, rank: int = 4) -> TorchBackend:
    backend = TorchBackend(lr=1e-2, threads=2)
    backend.load(model.path)
    backend.add_lora(rank=rank, alpha=2.0 * rank, seed=1)
    return backend


def completion_logprobs(backend: TorchBackend, lora: bool = True) -> np.ndarray:
    batch = make_batch([PROMPT], [COMPLETION])
    values = backend.logprobs(batch) if lora else backend.reference_logprobs(batch)
    return values.detach().double().numpy()[0][np.asarray(batch.mask[0]) > 0]


def randomize_lora_b(backend: TorchBackend, scale: float = 0.3) -> None:
    """peft starts B at zero (no effect); give it values so the adapter changes something."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in backend.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


def test_trainer_logprobs_equal_the_engine(tiny):
    backend = trainer_for(tiny)
    with engine_for(tiny) as engine:
        expected = engine.token_logprobs(PROMPT, COMPLETION)
    assert np.abs(completion_logprobs(backend) - expected).max() <= 1e-4  # B = 0: the base model
    assert np.abs(completion_logprobs(backend, lora=False) - expected).max() <= 1e-4


def test_gradients_match_finite_differences(tiny):
    """Central differences in float64. transformers' RMSNorm computes in float32 whatever the
    model's dtype, which would drown a small step in rounding, so here it runs in float64."""
    backend = trainer_for(tiny)
    randomize_lora_b(backend, 0.1)
    backend.model.double()
    for module in backend.model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _float64_rms_norm(module)
    batch = make_batch([PROMPT], [COMPLETION])
    mask = torch.tensor(batch.mask, dtype=torch.float64)

    def loss() -> torch.Tensor:
        return -(backend.logprobs(batch).double() * mask).sum() / mask.sum()

    params = [(n, p) for n, p in backend.model.named_parameters() if p.requires_grad]
    value = loss()
    value.backward()
    rng = np.random.default_rng(0)
    checked = 0
    for name, param in [params[i] for i in rng.choice(len(params), 6, replace=False)]:
        index = tuple(int(rng.integers(0, d)) for d in param.shape)
        analytic = float(param.grad[index])
        with torch.no_grad():
            original = float(param[index])
            param[index] = original + EPS
            up = float(loss())
            param[index] = original - EPS
            down = float(loss())
            param[index] = original
        numeric = (up - down) / (2 * EPS)
        assert abs(analytic - numeric) <= 1e-8 + 1e-5 * abs(numeric), (name, analytic, numeric)
        checked += 1
    assert checked == 6


def _float64_rms_norm(module):
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        return module.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)

    return forward


def test_exported_adapter_passes_parity_and_a_wrong_one_fails(tiny, tmp_path):
    backend = trainer_for(tiny)
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
        randomize_lora_b(backend, 0.5)  # the trainer moves on: the old export no longer matches
        stale = parity_check(engine, adapter, backend, samples, tolerance=1e-4)
    assert not stale.ok and "FAILED" in stale.summary()


def test_a_step_moves_the_policy_toward_the_target(tiny):
    backend = trainer_for(tiny)
    batch = make_batch([PROMPT], [COMPLETION])
    mask = backend.mask(batch)
    before = completion_logprobs(backend).sum()
    for _ in range(5):
        backend.step(-(backend.logprobs(batch) * mask).sum() / mask.sum())
    assert completion_logprobs(backend).sum() > before + 0.1
