"""How Qwen3.5/3.6-MoE (`qwen35moe`) weights are laid out in GGUF, relative to the HF checkpoint.

llama.cpp's `convert_hf_to_gguf.py` is the ground truth for the base tensors; a LoRA must be
split, stacked and reordered exactly as the base weight it adapts was. What that converter does
for this architecture (read from the llama.cpp vendored by llama-cpp-python 0.3.36):

- Gated DeltaNet value heads: HF groups them by key head (`[k0: v0 v1 | k1: v0 v1]`); GGUF
  tiles them (`[k0v0 k1v0 | k0v1 k1v1]`) so ggml can broadcast. The rows of `in_proj_qkv`'s V
  part, `in_proj_z`, `in_proj_b`, `in_proj_a` (and `A_log`, `dt_bias`, conv1d's V channels) are
  reordered that way; `out_proj` gets the same order on its *columns*. A LoRA follows: B's rows
  for the input projections, A's columns for `out_proj`.
- `mlp.experts.gate_up_proj` `(E, 2 ff, hidden)` is split into `ffn_gate_exps` (first ff rows)
  and `ffn_up_exps` (the rest); `down_proj` `(E, hidden, ff)` is `ffn_down_exps` unchanged.
  (Converted with `--fuse-gate-up-exps`, the base has one `ffn_gate_up_exps` instead.)
- Full attention `q_proj` keeps its rows: each head's query and output gate stay interleaved
  (`[q_h | gate_h]` per head) and llama.cpp's graph views them apart. No rope permutation.
- Zero-centred RMSNorm weights get +1 (not `linear_attn.norm`); `A_log` becomes `-exp(A_log)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ARCH = "qwen35moe"


@dataclass(frozen=True)
class LinearAttentionDims:
    """The Gated DeltaNet head layout, as GGUF metadata states it (`ssm.*`)."""

    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    head_dim: int  # ssm.state_size (llama.cpp uses it for keys and values alike)

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_dim

    @classmethod
    def from_hparams(cls, hparams: dict) -> LinearAttentionDims:
        """From a base's GGUF metadata (`BaseModelInfo.hparams`); zeros where it has none."""
        return cls(
            hparams.get("ssm.group_count", 0), hparams.get("ssm.time_step_rank", 0), hparams.get("ssm.state_size", 0)
        )


def v_head_order(n_k_heads: int, n_v_heads: int, head_dim: int) -> np.ndarray:
    """Index array taking grouped V rows (HF) to tiled V rows (GGUF): `gguf = hf[order]`."""
    per_k = n_v_heads // n_k_heads
    index = np.arange(n_v_heads * head_dim).reshape(n_k_heads, per_k, head_dim)
    return index.transpose(1, 0, 2).reshape(-1)


def linear_attn_rows(module: str, dims: LinearAttentionDims) -> np.ndarray | None:
    """Row order for the output rows of a linear-attention input projection (None: unchanged).

    `module` is the HF module's last name: in_proj_qkv, in_proj_z, in_proj_b or in_proj_a.
    """
    if dims.n_k_heads == dims.n_v_heads:
        return None
    if module == "in_proj_qkv":
        v = v_head_order(dims.n_k_heads, dims.n_v_heads, dims.head_dim) + 2 * dims.key_dim
        return np.concatenate([np.arange(2 * dims.key_dim), v])
    if module == "in_proj_z":
        return v_head_order(dims.n_k_heads, dims.n_v_heads, dims.head_dim)
    if module in ("in_proj_b", "in_proj_a"):
        return v_head_order(dims.n_k_heads, dims.n_v_heads, 1)
    return None


def out_proj_columns(dims: LinearAttentionDims) -> np.ndarray | None:
    """Column order of `out_proj` (its input is the V heads), None when unchanged."""
    if dims.n_k_heads == dims.n_v_heads:
        return None
    return v_head_order(dims.n_k_heads, dims.n_v_heads, dims.head_dim)


def lora_orders(module: str, dims: LinearAttentionDims) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(B's row order, A's column order) that take a HF LoRA on `module` (its full dotted name)
    to its GGUF tensor (`gguf = hf[order]`); None where that side is unchanged. Only the Gated
    DeltaNet projections move; reading a GGUF LoRA back undoes them with `np.argsort`."""
    parent, _, name = module.rpartition(".")
    if not parent.endswith("linear_attn"):
        return None, None
    if name == "out_proj":
        return None, out_proj_columns(dims)
    return linear_attn_rows(name, dims), None


def split_gate_up(rows: np.ndarray, axis: int = -2) -> tuple[np.ndarray, np.ndarray]:
    """Gate rows first, then up rows: the split convert_hf_to_gguf applies to gate_up_proj."""
    n = rows.shape[axis]
    if n % 2:
        raise ValueError(f"gate_up has an odd number of rows ({n})")
    gate, up = np.split(rows, 2, axis=axis)
    return gate, up
