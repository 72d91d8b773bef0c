"""Tiny random GGUF base models for tests.

Real models are far too big for unit tests, and a model that ships in a package gives no way to
check llama.cpp's numbers. These builders write small random ``llama`` / ``qwen3`` models with
gguf-py that llama.cpp loads like any other GGUF, and keep the exact float32 weights they wrote,
so ``tests/reference.py`` can recompute the logits independently in float64 numpy.

Conventions (the ones llama.cpp and gguf-py use, so adapters and converters can be tested):

* Tensors are keyed by their GGUF names (``blk.0.attn_q.weight`` ...).
* Numpy shapes are the ones handed to ``GGUFWriter.add_tensor``: HF ``nn.Linear`` ``(out, in)``;
  ``token_embd`` / ``output`` are ``(n_vocab, n_embd)``; norms are 1-D.
* For ``llama`` the stored q/k rows are in GGUF order, i.e. already permuted for llama.cpp's
  adjacent-pair ("norm") rope. Weights coming from an HF checkpoint must go through
  :func:`permute_qk` first (``convert_hf_to_gguf.py`` does the same); ``qwen3`` is not permuted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np

if TYPE_CHECKING:
    from macaron_local.learn.backends.torch_backend import TorchBackend

__all__ = [
    "ARCHES",
    "CHATML_TEMPLATE",
    "TinyConfig",
    "TinyModel",
    "build_tiny_model",
    "permute_qk",
    "random_weights",
    "tensor_shapes",
    "tiny_trainer",
    "unpermute_qk",
    "write_tiny_model",
]

ARCHES = ("llama", "qwen3")

#: A minimal ChatML template, so chat-formatting code paths have something real to render.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Special tokens at the start of the vocabulary: bos, ChatML start, ChatML end (= eos).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID = 0
EOS_ID = 2

# Byte-level BPE (gpt2) stores bytes as printable code points: "Ġ" is a space, "Ċ" a newline.
_ALPHABET = (
    ["Ġ", "Ċ"]
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    + [chr(c) for c in range(ord("0"), ord("9") + 1)]
    + list(".,!?:;'\"-()")
)


@dataclass
class TinyConfig:
    """Shape and hyper-parameters of a tiny model.

    ``head_dim`` defaults to ``n_embd // n_head``; qwen3 (like the real Qwen3 models) may use a
    different value, which makes the q/o projections non-square and catches shape mix-ups.
    """

    arch: str = "llama"
    n_vocab: int = 64
    n_embd: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None
    n_ff: int = 48
    tied_output: bool = False
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_ctx_train: int = 256

    def __post_init__(self) -> None:
        if self.arch not in ARCHES:
            raise ValueError(f"arch must be one of {ARCHES}, got {self.arch!r}")
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError("n_embd must be a multiple of n_head when head_dim is not given")
            self.head_dim = self.n_embd // self.n_head
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rope rotates pairs)")
        if self.n_head % self.n_head_kv:
            raise ValueError("n_head must be a multiple of n_head_kv (GQA groups)")
        if self.n_vocab < len(SPECIAL_TOKENS) + 3:
            raise ValueError(f"n_vocab must be at least {len(SPECIAL_TOKENS) + 3}")


@dataclass
class TinyModel:
    """A GGUF file on disk plus the exact weights written into it (float32, GGUF names)."""

    path: Path
    config: TinyConfig
    weights: dict[str, np.ndarray] = field(repr=False)


def tensor_shapes(config: TinyConfig) -> dict[str, tuple[int, ...]]:
    """Numpy shapes of every tensor of a model with this config, in GGUF writing order.

    Useful on its own for writing adapters: a LoRA pair for ``name`` of shape ``(out, in)`` is
    ``A (rank, in)`` and ``B (out, rank)``.
    """
    c = config
    hd = c.head_dim
    assert hd is not None
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.n_vocab, c.n_embd)}
    for i in range(c.n_layer):
        p = f"blk.{i}."
        shapes[p + "attn_norm.weight"] = (c.n_embd,)
        shapes[p + "attn_q.weight"] = (c.n_head * hd, c.n_embd)
        shapes[p + "attn_k.weight"] = (c.n_head_kv * hd, c.n_embd)
        shapes[p + "attn_v.weight"] = (c.n_head_kv * hd, c.n_embd)
        shapes[p + "attn_output.weight"] = (c.n_embd, c.n_head * hd)
        if c.arch == "qwen3":
            shapes[p + "attn_q_norm.weight"] = (hd,)
            shapes[p + "attn_k_norm.weight"] = (hd,)
        shapes[p + "ffn_norm.weight"] = (c.n_embd,)
        shapes[p + "ffn_gate.weight"] = (c.n_ff, c.n_embd)
        shapes[p + "ffn_up.weight"] = (c.n_ff, c.n_embd)
        shapes[p + "ffn_down.weight"] = (c.n_embd, c.n_ff)
    shapes["output_norm.weight"] = (c.n_embd,)
    if not c.tied_output:
        shapes["output.weight"] = (c.n_vocab, c.n_embd)
    return shapes


def random_weights(config: TinyConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights for ``config``.

    Scales are chosen so that activations stay O(1) through the layers and logits spread by a
    few units across the vocabulary: a test then sees real differences between tokens, while
    float32 rounding in llama.cpp stays far below the 1e-4 comparison tolerance. Norm weights
    are ``1 + noise`` rather than ones, so a norm whose weight is ignored cannot go unnoticed.
    """
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in tensor_shapes(config).items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "token_embd.weight":
            w = 0.5 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        weights[name] = w.astype(np.float32)
    return weights


def _pair_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that turns per-head [first half; second half] into interleaved pairs.

    Within each head of size ``d``, output row ``2j`` takes input row ``j`` and output row
    ``2j + 1`` takes input row ``j + d/2``.
    """
    if n_rows % n_head:
        raise ValueError(f"{n_rows} rows do not split into {n_head} heads")
    d = n_rows // n_head
    if d % 2:
        raise ValueError(f"head size {d} is odd")
    half = d // 2
    j = np.arange(half)
    within = np.empty(d, dtype=np.int64)
    within[0::2] = j
    within[1::2] = j + half
    return (np.arange(n_head)[:, None] * d + within[None, :]).reshape(-1)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Permute q/k projection rows from HF (half-split rope) to GGUF llama (pair rope) order.

    HF llama rotates dimension ``j`` with ``j + d/2`` inside each head; llama.cpp's llama graph
    rotates adjacent pairs ``(2j, 2j + 1)``. ``convert_hf_to_gguf.py`` therefore reorders the
    rows of ``q_proj`` (by ``n_head``) and ``k_proj`` (by ``n_head_kv``); the same must happen to
    anything that produces those rows, such as a LoRA ``B`` matrix. Works on any array whose
    first axis is the output dimension (weights ``(out, in)``, LoRA B ``(out, rank)``, biases).
    """
    w = np.asarray(w)
    return w[_pair_rows(w.shape[0], n_head)]


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk`: GGUF llama q/k row order back to HF order."""
    w = np.asarray(w)
    out = np.empty_like(w)
    out[_pair_rows(w.shape[0], n_head)] = w
    return out


def _vocab(n_vocab: int) -> tuple[list[str], list[str]]:
    """Unique tokens and a non-empty merges list for a gpt2-style BPE tokenizer.

    Specials come first, then single characters, then two-character tokens, each of which is
    the result of one listed merge, so llama.cpp's BPE tokenizer can produce every token.
    """
    n_free = n_vocab - len(SPECIAL_TOKENS)
    n_single = min(len(_ALPHABET), max(2, n_free - max(1, n_free // 8)))
    singles = _ALPHABET[:n_single]
    pairs = itertools.islice(itertools.product(singles, repeat=2), n_free - n_single)
    merges = [f"{a} {b}" for a, b in pairs]
    if len(merges) < n_free - n_single:
        raise ValueError(f"n_vocab={n_vocab} is too large for the tiny tokenizer")
    tokens = list(SPECIAL_TOKENS) + singles + [m.replace(" ", "") for m in merges]
    assert len(tokens) == n_vocab and len(set(tokens)) == n_vocab
    return tokens, merges


def write_tiny_model(path: str | Path, config: TinyConfig, weights: dict[str, np.ndarray]) -> TinyModel:
    """Write ``weights`` (GGUF names and row order) as a GGUF model file at ``path``.

    Split from :func:`random_weights` so a test can write weights it derived itself, e.g.
    HF-convention weights permuted with :func:`permute_qk`.
    """
    path = Path(path)
    c = config
    expected = tensor_shapes(c)
    if set(weights) != set(expected):
        missing = sorted(set(expected) - set(weights))
        extra = sorted(set(weights) - set(expected))
        raise ValueError(f"weights do not match config: missing {missing}, extra {extra}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{name}: shape {weights[name].shape}, expected {shape}")

    writer = gguf.GGUFWriter(str(path), c.arch)
    writer.add_name(f"tiny-{c.arch}")
    writer.add_context_length(c.n_ctx_train)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(c.n_ff)
    writer.add_head_count(c.n_head)
    writer.add_head_count_kv(c.n_head_kv)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens, merges = _vocab(c.n_vocab)
    token_types = [
        gguf.TokenType.CONTROL if i < len(SPECIAL_TOKENS) else gguf.TokenType.NORMAL for i in range(c.n_vocab)
    ]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    stored: dict[str, np.ndarray] = {}
    for name in expected:
        arr = np.ascontiguousarray(weights[name], dtype=np.float32)
        stored[name] = arr
        writer.add_tensor(name, arr)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyModel(path=path, config=c, weights=stored)


def build_tiny_model(path: str | Path, config: TinyConfig | None = None, seed: int = 0) -> TinyModel:
    """Write a random tiny model to ``path`` and return it with its weights."""
    config = config or TinyConfig()
    return write_tiny_model(path, config, random_weights(config, seed))


def tiny_trainer(model: TinyModel, lr: float = 1e-4, rank: int = 4) -> TorchBackend:
    """The torch trainer on ``model`` with a fresh LoRA (alpha = 2 x rank, two threads): what
    the learning tests train. Torch is imported here, so the builders above need none."""
    from macaron_local.learn.backends.torch_backend import TorchBackend

    backend = TorchBackend(lr=lr, threads=2)
    backend.load(model.path)
    backend.add_lora(rank=rank, alpha=2.0 * rank)
    return backend
