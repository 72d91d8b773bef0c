"""Both trainers (torch, mlx) on Tall's architecture (a tiny random qwen3_5_moe): loaded from a local HF
checkpoint (the manifest's trainer checkpoint), the slot's expert stacked as a frozen LoRA read
from its PEFT files, the personal LoRA on Tall's targets on top.

Bounds: log-probabilities within 1e-4 nats of llama.cpp's (F32 base, F32 adapters, F32 KV cache;
measured about 1e-5) with the expert alone, and with expert + exported personal adapter stacked;
each adapter moves them by more than 0.05, so a dropped or misplaced one fails. Gradients: central
differences in float64.
"""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest
import tiny_qwen35moe as tq

from macaron_local.adapters import BaseModelInfo, read_adapter
from macaron_local.adapters.peft import convert_peft_dir
from macaron_local.engine import Engine, EngineConfig
from macaron_local.errors import MacaronError
from macaron_local.learn import losses
from macaron_local.learn.backends.base import make_batch
from macaron_local.learn.backends.checkpoint import choose_quantization, resolve_checkpoint
from macaron_local.learn.export import export_gguf, parity_check
from macaron_local.learn.stacking import PERSONAL_TARGETS
from macaron_local.learn.warm import warm_start

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "peft", "transformers")), reason="builds with transformers"
)
BACKENDS = [
    "torch",
    pytest.param("mlx", marks=pytest.mark.skipif(not importlib.util.find_spec("mlx_lm"), reason="needs [mlx]")),
]
PROMPT, COMPLETION = [0, 5, 17, 33, 9, 9, 41, 2], [12, 60, 7, 1, 25]
ALL_GROUPS = ("attention", "linear_attention", "shared_expert")
GIB = 1024**3


@pytest.fixture(scope="module")
def tall(tmp_path_factory):
    """The tiny base (GGUF for llama.cpp, HF directory for the trainer) and two experts (PEFT
    directory for the trainer, GGUF converted from it for the engine), on every Macaron target."""
    root = tmp_path_factory.mktemp("tall")
    tiny = tq.build(root, seed=0)
    checkpoint = root / "checkpoint"
    tiny.model.save_pretrained(checkpoint)
    base = BaseModelInfo.from_gguf(tiny.gguf_path)
    experts = {}
    for seed in (1, 2):
        model = tq.add_random_lora(copy.deepcopy(tiny.model), 8, seed, groups=ALL_GROUPS, experts=True, alpha=4.0)
        peft_dir = root / f"expert-{seed}"
        model.save_pretrained(peft_dir)
        experts[seed] = (peft_dir, convert_peft_dir(peft_dir, base, root / f"expert-{seed}.gguf", dtype="F32"))
    return tiny, checkpoint, base, experts


@pytest.fixture(scope="module")
def engine(tall):
    tiny = tall[0]
    with Engine(EngineConfig(model_path=tiny.gguf_path, n_ctx=64, kv_f32=True, n_threads=2)) as engine:
        yield engine


def trainer(checkpoint, lr: float = 1e-2, name: str = "torch", bits: int | str | None = None, rank: int = 4):
    if name == "mlx":
        from macaron_local.learn.backends.mlx_backend import MlxBackend

        backend = MlxBackend(lr=lr, bits=bits, group_size=32)  # the tiny experts' ff is 32
    else:
        from macaron_local.learn.backends.torch_backend import TorchBackend

        backend = TorchBackend(lr=lr, threads=2)
    backend.load(checkpoint.parent / "unused.gguf", checkpoint=str(checkpoint))
    backend.add_lora(rank=rank, alpha=2.0 * rank, seed=1)
    return backend


def randomize_personal(backend, scale: float = 0.3, seed: int = 7) -> None:
    rng = np.random.default_rng(seed)
    for name, values in backend.lora_weights().items():
        if name.endswith("lora_B"):
            backend.set_lora_weight(name, rng.normal(0, scale, values.shape))


def scored(backend, lora: bool = True, prompt=PROMPT, completion=COMPLETION) -> np.ndarray:
    batch = make_batch([prompt], [completion])
    values = backend.logprobs(batch) if lora else backend.reference_logprobs(batch)
    return backend.to_numpy(values)[0][np.asarray(batch.mask[0]) > 0]


def served(engine, handles) -> np.ndarray:
    engine.set_adapters(handles)
    try:
        return engine.token_logprobs(PROMPT, COMPLETION)
    finally:
        engine.set_adapters([])


def sft(logp, reference, mask):
    return losses.sft_loss(logp, mask), {}


def expert_weights(backend) -> dict[str, np.ndarray]:
    """The stacked expert's parameters as numpy (empty when none is stacked)."""
    if backend.name == "torch":
        return {n: p.detach().numpy().copy() for n, p in backend.model.named_parameters() if ".expert." in n}
    return {
        f"{i}.{half}": np.array(getattr(wrapper, half))
        for i, (_, _, wrapper) in enumerate(backend._expert_layers)  # noqa: SLF001
        for half in ("lora_a", "lora_b")
    }


@pytest.mark.parametrize("name", BACKENDS)
def test_qwen3_5_moe_trainer_stacks_the_expert_as_llama_cpp_serves_it(tall, engine, tmp_path, name):
    _, checkpoint, base, experts = tall
    backend = trainer(checkpoint, name=name)
    assert backend.stacks_experts
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in backend.lora_weights()}
    assert targets == {t.rsplit(".", 1)[-1] for t in PERSONAL_TARGETS}  # no routed experts, no head
    peft_dir, expert_gguf = experts[1]
    backend.stack_expert(peft_dir)
    randomize_personal(backend)
    personal = export_gguf(backend, base, tmp_path / "personal.gguf", task_name="personal")
    assert read_adapter(personal).ranks == {4}
    expert_h, personal_h = engine.load_adapter(expert_gguf), engine.load_adapter(personal)
    bare, with_expert, both = served(engine, []), served(engine, [expert_h]), served(engine, [expert_h, personal_h])
    assert np.abs(with_expert - bare).max() > 0.05 and np.abs(both - with_expert).max() > 0.05
    assert np.abs(scored(backend, lora=False) - with_expert).max() <= 1e-4  # the reference: expert alone
    assert np.abs(scored(backend) - both).max() <= 1e-4  # expert + personal, summed
    # Switching experts frees the first and stacks the second; None leaves the bare base.
    other_dir, other_gguf = experts[2]
    backend.stack_expert(other_dir)
    assert np.abs(scored(backend, lora=False) - served(engine, [engine.load_adapter(other_gguf)])).max() <= 1e-4
    backend.stack_expert(None)
    assert np.abs(scored(backend, lora=False) - bare).max() <= 1e-4
    assert not expert_weights(backend)  # freed


@pytest.mark.parametrize("name", BACKENDS)
def test_qwen3_5_moe_trainer_gradients_match_finite_differences(tall, name):
    """Directional central differences, one random direction per target group, with the expert
    stacked underneath (its frozen path is inside the derivative). The model casts to float32
    inside (norms, rope, the delta rule), so float64 does not help; a step along a whole
    direction moves the loss far above float32 rounding, and a wrong gradient in any one group
    (a sign, a missing scale, a dropped term) fails its direction."""
    _, checkpoint, _, experts = tall
    backend = trainer(checkpoint, name=name)
    backend.stack_expert(experts[1][0])
    randomize_personal(backend, 0.1)
    batch = make_batch([PROMPT], [COMPLETION])

    def loss() -> float:
        return float(backend.to_numpy(sft(backend.logprobs(batch), None, backend.mask(batch))[0]))

    grads = backend.gradients(batch, sft)
    weights = backend.lora_weights()
    assert set(grads) == set(weights) and all(".expert" not in n for n in grads)
    rng = np.random.default_rng(0)
    groups = {"attention": ".self_attn.", "linear_attention": ".linear_attn.", "shared_expert": ".shared_expert"}
    eps = 1e-2
    for group, key in groups.items():
        names = [n for n in weights if key in n]
        direction = {n: rng.normal(0, 1, weights[n].shape) for n in names}
        norm = np.sqrt(sum((d**2).sum() for d in direction.values()))
        direction = {n: d / norm for n, d in direction.items()}
        analytic = sum(float((grads[n] * direction[n]).sum()) for n in names)
        moved = {}
        for sign in (1, -1):
            for n in names:
                backend.set_lora_weight(n, weights[n] + sign * eps * direction[n])
            moved[sign] = loss()
        for n in names:
            backend.set_lora_weight(n, weights[n])
        numeric = (moved[1] - moved[-1]) / (2 * eps)
        assert abs(numeric) > 1e-3, group  # the direction matters
        assert abs(analytic - numeric) <= 2e-4 + 1e-2 * abs(numeric), (group, analytic, numeric)


@pytest.mark.parametrize("name", BACKENDS)
def test_qwen3_5_moe_trainer_export_parity_and_a_frozen_expert(tall, engine, tmp_path, name):
    """Training moves only the personal LoRA; the export passes the deployment parity check (on
    the bare base, as the nightly run checks it) and a stale export fails it."""
    _, checkpoint, base, experts = tall
    backend = trainer(checkpoint, lr=3e-2, name=name)
    backend.stack_expert(experts[1][0])
    frozen = expert_weights(backend)
    assert frozen
    batch = make_batch([PROMPT, [3, 4]], [COMPLETION, [8, 9, 10]])
    before = scored(backend).sum()
    for _ in range(4):
        backend.train_step(batch, sft, with_reference=True)
    assert scored(backend).sum() > before + 0.1
    for key, values in expert_weights(backend).items():
        assert np.array_equal(values, frozen[key]), key
    backend.stack_expert(None)
    adapter = export_gguf(backend, base, tmp_path / "personal.gguf")
    samples = [(PROMPT, COMPLETION), ([1, 2, 3], [4, 5, 6, 7])]
    report = parity_check(engine, adapter, backend, samples, tolerance=1e-4)
    assert report.ok, report.summary()
    randomize_personal(backend, 0.5, seed=8)
    assert not parity_check(engine, adapter, backend, samples, tolerance=1e-4).ok


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("rank", [4, 8])
def test_qwen3_5_moe_night_continues_the_deployed_version_exactly(tall, tmp_path, name, rank):
    """Warm start on Tall's layout: the exported personal adapter read back into a fresh trainer
    (same rank, or widened) scores as the one that wrote it. The tiny model has more value than
    key heads, so the Gated DeltaNet rows and out_proj columns the export reorders must be put
    back: read in GGUF order, the night started from a scrambled adapter (0.6 nats off)."""
    _, checkpoint, base, _ = tall
    writer = trainer(checkpoint, name=name)
    randomize_personal(writer)
    deployed = export_gguf(writer, base, tmp_path / "deployed.gguf", task_name="personal")
    reader = trainer(checkpoint, name=name, rank=rank)
    note = warm_start(reader, deployed, base, rank, 2.0 * rank)
    assert note.startswith("continued from the deployed version") and ("widened" in note) == (rank == 8)
    expected, bare = scored(writer), scored(writer, lora=False)
    assert np.abs(expected - bare).max() > 0.05
    np.testing.assert_allclose(scored(reader), expected, atol=1e-4)
    moved = [k for k in reader.lora_weights() if "linear_attn" in k]
    assert moved  # the layers whose order the export changes are among those read back


def test_qwen3_5_moe_trainer_quantization_choice_and_checkpoint_resolution(tmp_path):
    tall_bf16 = 70 * GIB  # Qwen3.6-35B-A3B's BF16 weights
    assert choose_quantization(tall_bf16, None) is None  # CPU / MLX: no bitsandbytes
    assert choose_quantization(tall_bf16, 141 * GIB) is None  # an H200 trains it in BF16
    assert choose_quantization(tall_bf16, 48 * GIB) == "8bit"
    assert choose_quantization(tall_bf16, 32 * GIB) == "4bit"
    with pytest.raises(MacaronError, match="even in 4 bits"):
        choose_quantization(tall_bf16, 24 * GIB)
    with pytest.raises(MacaronError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MacaronError, match="no config.json"):
        resolve_checkpoint(tmp_path / "empty")


def test_qwen3_5_moe_trainer_sampler_scores_after_another_sequence(engine):
    """The training loop scores each sample right after the previous one; Gated DeltaNet's
    recurrent state cannot be cut back to a shared prefix, so the engine starts it over."""
    engine.set_adapters([])
    first = engine.token_logprobs(PROMPT, COMPLETION)
    other = engine.token_logprobs(PROMPT, [3, 3, 8])  # the same prompt, another completion
    again = engine.token_logprobs(PROMPT, COMPLETION)
    assert other.shape == (3,)
    np.testing.assert_allclose(again, first, atol=1e-5)


def test_qwen3_5_moe_trainer_mlx_4bit_base_stacks_and_trains(tall, tmp_path):
    """Tall's Mac plan: mlx-lm's qwen3_5_moe with a 4-bit base, the expert stacked in full
    precision, the personal LoRA trained and exported. (At this toy size 4 bits move a random
    model's routing, so values are not compared with llama.cpp's F32 base here; the F32 tests
    above hold the math, this one the quantized code path.)"""
    if not importlib.util.find_spec("mlx_lm"):
        pytest.skip("needs [mlx]")
    import mlx.nn as nn

    _, checkpoint, base, experts = tall
    backend = trainer(checkpoint, lr=3e-2, name="mlx", bits="auto")  # the default: 4-bit for Tall-class models
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in backend.model.named_modules())
    backend.stack_expert(experts[1][0])
    assert np.abs(scored(backend, lora=False) - scored(backend)).max() == 0  # B = 0: no personal effect yet
    batch = make_batch([PROMPT, [3, 4]], [COMPLETION, [8, 9, 10]])
    losses_seen = [backend.train_step(batch, sft, with_reference=True).loss for _ in range(4)]
    assert losses_seen[-1] < losses_seen[0]
    adapter = export_gguf(backend, base, tmp_path / "personal.gguf")  # validated against the base
    assert read_adapter(adapter).ranks == {4}
