"""An independent float64 numpy forward pass for the tiny models of ``tests/tinymodels.py``.

Tests compare llama.cpp's logits against this to prove that what we hand llama.cpp (base
models, LoRA adapter files, scales, several adapters at once) means what we think it means.
It is written from the model definitions, not from llama.cpp's code, and runs in float64 so
that any disagreement beyond float32 rounding (about 1e-5 here) is a real bug.

Rope: llama.cpp's ``llama`` graph rotates adjacent pairs ``(2j, 2j+1)`` ("norm" style) on q/k
rows that the HF-to-GGUF converter permuted; ``qwen3`` rotates ``(j, j + d/2)`` ("neox" style,
the HF convention) on unpermuted rows. :func:`reference_logits` picks the style from the
architecture; ``rope_style=`` overrides it, so a test can run the HF convention (``"neox"`` on
unpermuted llama weights) and check that permuting with ``tinymodels.permute_qk`` gives the
same logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only a type: keeps this module importable however tests/ is put on the path
    from tinymodels import TinyModel

__all__ = ["LoraDelta", "effective_weights", "reference_logits"]

ROPE_STYLES = ("norm", "neox")
_DEFAULT_ROPE = {"llama": "norm", "qwen3": "neox"}


@dataclass
class LoraDelta:
    """One LoRA adapter as the tests see it.

    ``tensors`` maps a base tensor name (``"blk.0.attn_q.weight"``) to ``(A, B)`` with the numpy
    shapes an adapter GGUF stores: ``A (rank, in)`` and ``B (out, rank)``. For
    ``token_embd.weight`` (an embedding lookup, not a matmul) they are ``A (n_vocab, rank)`` and
    ``B (n_embd, rank)``, as llama.cpp expects.

    The update is ``scale * (alpha / rank) * B @ A``, where ``scale`` is the user scale passed
    to ``llama_set_adapters_lora``. As in llama.cpp, ``alpha == 0`` means "no alpha/rank factor"
    (the update is then ``scale * B @ A``), which is what an adapter without
    ``adapter.lora.alpha`` gets.
    """

    tensors: dict[str, tuple[np.ndarray, np.ndarray]] = field(repr=False)
    alpha: float
    scale: float = 1.0

    def factor(self, rank: int) -> float:
        """The number that multiplies ``B @ A`` for a pair of this rank."""
        return self.scale * (self.alpha / rank if self.alpha else 1.0)


def effective_weights(model: TinyModel, loras: Sequence[LoraDelta] = ()) -> dict[str, np.ndarray]:
    """Float64 copies of the model's weights with every LoRA update added in.

    Several adapters add up, like llama.cpp's active adapter set. Raises ``ValueError`` on an
    unknown tensor name, a shape mismatch or a LoRA on a norm vector, rather than ignoring it
    the way llama.cpp does, because a test that passes such an adapter has a bug of its own.
    """
    weights = {k: np.asarray(v, dtype=np.float64) for k, v in model.weights.items()}
    for lora in loras:
        for name, (a, b) in lora.tensors.items():
            if name not in weights:
                raise ValueError(f"LoRA targets unknown tensor {name!r}")
            w = weights[name]
            if w.ndim != 2:
                raise ValueError(f"LoRA on 1-D tensor {name!r} is not supported")
            a = np.asarray(a, dtype=np.float64)
            b = np.asarray(b, dtype=np.float64)
            if name == "token_embd.weight":
                if model.config.tied_output:
                    # llama.cpp would also route this pair through the tied output head,
                    # where the shapes do not fit; refuse instead of guessing.
                    raise ValueError("LoRA on token_embd of a tied model is not supported")
                n_vocab, n_embd = w.shape
                rank = a.shape[1]
                if a.shape != (n_vocab, rank) or b.shape != (n_embd, rank):
                    raise ValueError(f"{name}: lora shapes {a.shape}, {b.shape} do not fit")
                weights[name] = w + lora.factor(rank) * (a @ b.T)
                continue
            out_dim, in_dim = w.shape
            rank = a.shape[0]
            if a.shape != (rank, in_dim) or b.shape != (out_dim, rank):
                raise ValueError(f"{name}: lora A {a.shape} / B {b.shape} do not fit weight {w.shape}")
            weights[name] = w + lora.factor(rank) * (b @ a)
    return weights


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, then the elementwise weight."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, theta: float, style: str) -> np.ndarray:
    """Rotary embedding of ``x`` shaped (T, heads, d) at positions 0..T-1.

    Pair ``j`` (``j < d/2``) turns by ``pos * theta**(-2j/d)``. "norm" pairs dimensions
    ``(2j, 2j+1)``; "neox" pairs ``(j, j + d/2)``.
    """
    n_tok, _, d = x.shape
    half = d // 2
    inv_freq = theta ** (-2.0 * np.arange(half) / d)
    ang = np.arange(n_tok, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(ang)[:, None, :]
    sin = np.sin(ang)[:, None, :]
    out = np.empty_like(x)
    if style == "norm":
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
    elif style == "neox":
        x0, x1 = x[..., :half], x[..., half:]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:] = x0 * sin + x1 * cos
    else:
        raise ValueError(f"rope_style must be one of {ROPE_STYLES}, got {style!r}")
    return out


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def reference_logits(
    model: TinyModel,
    tokens: Sequence[int],
    loras: Sequence[LoraDelta] = (),
    *,
    rope_style: str | None = None,
) -> np.ndarray:
    """Logits for every position of ``tokens``, shape ``(len(tokens), n_vocab)``, float64.

    Pre-norm decoder: RMSNorm -> causal GQA attention (query head ``h`` reads kv head
    ``h // (n_head / n_head_kv)``; qwen3 RMS-normalises q and k per head before rope; scores
    scaled by ``1/sqrt(head_dim)``) -> residual -> RMSNorm -> SwiGLU MLP -> residual; final
    RMSNorm and the output head (``token_embd`` when the model is tied).

    ``rope_style`` (``"norm"`` | ``"neox"``) overrides the architecture's rope; ``None`` uses
    what llama.cpp uses for it (llama: norm, qwen3: neox). See the module docstring.
    """
    c = model.config
    style = rope_style or _DEFAULT_ROPE[c.arch]
    if style not in ROPE_STYLES:
        raise ValueError(f"rope_style must be one of {ROPE_STYLES}, got {style!r}")
    hd = c.head_dim
    assert hd is not None
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("tokens must be a non-empty 1-D sequence")
    if ids.min() < 0 or ids.max() >= c.n_vocab:
        raise ValueError("token id out of range")

    w = effective_weights(model, loras)
    n_tok = ids.size
    group = c.n_head // c.n_head_kv
    causal = np.tril(np.ones((n_tok, n_tok), dtype=bool))

    h = w["token_embd.weight"][ids]
    for i in range(c.n_layer):
        p = f"blk.{i}."
        x = _rms_norm(h, w[p + "attn_norm.weight"], c.rms_eps)
        q = (x @ w[p + "attn_q.weight"].T).reshape(n_tok, c.n_head, hd)
        k = (x @ w[p + "attn_k.weight"].T).reshape(n_tok, c.n_head_kv, hd)
        v = (x @ w[p + "attn_v.weight"].T).reshape(n_tok, c.n_head_kv, hd)
        if c.arch == "qwen3":
            q = _rms_norm(q, w[p + "attn_q_norm.weight"], c.rms_eps)
            k = _rms_norm(k, w[p + "attn_k_norm.weight"], c.rms_eps)
        q = _rope(q, c.rope_theta, style)
        k = _rope(k, c.rope_theta, style)

        k = np.repeat(k, group, axis=1)  # kv head j serves query heads j*group .. j*group+group-1
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores = np.where(causal[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n_tok, c.n_head * hd)
        h = h + attn @ w[p + "attn_output.weight"].T

        x = _rms_norm(h, w[p + "ffn_norm.weight"], c.rms_eps)
        gate = x @ w[p + "ffn_gate.weight"].T
        up = x @ w[p + "ffn_up.weight"].T
        h = h + (_silu(gate) * up) @ w[p + "ffn_down.weight"].T

    h = _rms_norm(h, w["output_norm.weight"], c.rms_eps)
    head = w["token_embd.weight"] if c.tied_output else w["output.weight"]
    return h @ head.T
