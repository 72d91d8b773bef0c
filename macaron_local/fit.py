"""Will Tall fit? Pure arithmetic from the published shapes: what each expert costs on disk and in
RAM at each GGUF storage type, and how many experts a machine can keep resident.

The shapes are Qwen3.6-35B-A3B's (transformers' `Qwen3_5MoeTextConfig` defaults match them):
40 layers (30 Gated DeltaNet + 10 gated full attention), hidden 2048, 256 routed experts with
ff 512, a shared expert with ff 512, attention 16 heads x 256 (2 KV heads), linear attention
16 key / 32 value heads x 128. A Macaron expert is rank 64 on every target. llama.cpp copies
adapter tensors into its own buffers (measured by bench/tall_fit.py: RSS grows by about the
file's size), so an expert resident in RAM costs its GGUF size.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf

#: Storage type for Tall's converted experts: the smallest whose measured logit error on the
#: tiny qwen3_5_moe (tests/test_qwen3_5_moe_parity.py) stays within TYPE_ERROR_BOUND.
TALL_EXPERT_TYPE = "Q8_0"
#: Median |logit error| over the median |logit change the adapter makes|.
TYPE_ERROR_BOUND = 0.10
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")

GIB = 1024**3
BASE_Q4_K_M_BYTES = 22_134_528_992  # unsloth/Qwen3.6-35B-A3B-GGUF, UD-Q4_K_M
N_EXPERTS_TALL = 4
#: RAM llama.cpp needs beyond the weights for a modest context (KV cache of the 10 attention
#: layers, recurrent state, compute buffers) and the app itself: a planning allowance.
RUNTIME_OVERHEAD_BYTES = 3 * GIB


@dataclass(frozen=True)
class TallShapes:
    n_layer: int = 40
    n_full_attention: int = 10
    hidden: int = 2048
    n_expert: int = 256
    expert_ff: int = 512
    shared_ff: int = 512
    n_head: int = 16
    n_head_kv: int = 2
    head_dim: int = 256
    linear_k_heads: int = 16
    linear_v_heads: int = 32
    linear_head_dim: int = 128
    rank: int = 64

    def pairs(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """(lora_a shape, lora_b shape, how many layers have it) for every GGUF pair of one expert."""
        h, r, e = self.hidden, self.rank, self.n_expert
        n_linear = self.n_layer - self.n_full_attention
        key_dim, value_dim = self.linear_k_heads * self.linear_head_dim, self.linear_v_heads * self.linear_head_dim
        q_out = self.n_head * self.head_dim * 2  # query and output gate, interleaved per head
        kv_out = self.n_head_kv * self.head_dim
        out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
        for rows in (q_out, kv_out, kv_out):  # attn_q, attn_k, attn_v
            out.append(((r, h), (rows, r), self.n_full_attention))
        out.append(((r, self.n_head * self.head_dim), (h, r), self.n_full_attention))  # attn_output
        for rows in (2 * key_dim + value_dim, value_dim, self.linear_v_heads, self.linear_v_heads):
            out.append(((r, h), (rows, r), n_linear))  # attn_qkv, attn_gate, ssm_beta, ssm_alpha
        out.append(((r, value_dim), (h, r), n_linear))  # ssm_out
        # Routed experts: gate and up each repeat the packed gate_up A (GGUF splits them).
        out.append(((e, r, h), (e, self.expert_ff, r), self.n_layer))  # ffn_gate_exps
        out.append(((e, r, h), (e, self.expert_ff, r), self.n_layer))  # ffn_up_exps
        out.append(((e, r, self.expert_ff), (e, h, r), self.n_layer))  # ffn_down_exps
        out.append(((r, h), (self.shared_ff, r), self.n_layer))  # ffn_gate_shexp
        out.append(((r, h), (self.shared_ff, r), self.n_layer))  # ffn_up_shexp
        out.append(((r, self.shared_ff), (h, r), self.n_layer))  # ffn_down_shexp
        out.append(((r, h), (1, r), self.n_layer))  # ffn_gate_inp_shexp
        return out


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of one tensor stored as `dtype` (rows not a multiple of the block fall back to F16,
    as the writer does)."""
    qtype = gguf.GGMLQuantizationType[dtype]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.F16]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def expert_bytes(dtype: str, shapes: TallShapes | None = None) -> int:
    """One converted Tall expert's GGUF tensor bytes at `dtype`."""
    shapes = shapes or TallShapes()
    return sum((tensor_bytes(a, dtype) + tensor_bytes(b, dtype)) * n for a, b, n in shapes.pairs())


def expert_parameters(shapes: TallShapes | None = None) -> int:
    shapes = shapes or TallShapes()
    total = 0
    for a, b, n in shapes.pairs():
        for shape in (a, b):
            count = 1
            for d in shape:
                count *= d
            total += count * n
    return total


@dataclass(frozen=True)
class FitRow:
    dtype: str
    expert_gb: float
    disk_gb: float  # base + four experts
    ram_gb: float  # base (mmapped, resident when used) + four resident experts + runtime allowance


def fit_table(base_bytes: int = BASE_Q4_K_M_BYTES, n_experts: int = N_EXPERTS_TALL) -> list[FitRow]:
    rows = []
    for dtype in TYPES:
        one = expert_bytes(dtype)
        rows.append(
            FitRow(
                dtype=dtype,
                expert_gb=round(one / 1e9, 2),
                disk_gb=round((base_bytes + n_experts * one) / 1e9, 1),
                ram_gb=round((base_bytes + n_experts * one + RUNTIME_OVERHEAD_BYTES) / 1e9, 1),
            )
        )
    return rows


def experts_that_fit(ram_bytes: int, dtype: str = TALL_EXPERT_TYPE, base_bytes: int = BASE_Q4_K_M_BYTES) -> int:
    """How many experts can stay resident in `ram_bytes` next to the base (0 to 4; at least one
    expert must fit for Tall to run: the routed one is loaded on demand)."""
    spare = ram_bytes - base_bytes - RUNTIME_OVERHEAD_BYTES
    return max(0, min(N_EXPERTS_TALL, spare // expert_bytes(dtype)))


def verdict(ram_bytes: int, disk_free_bytes: int | None, dtype: str = TALL_EXPERT_TYPE) -> tuple[bool, str]:
    """(can run, one line with the numbers) for `macaron doctor` and the first-run screen."""
    one = expert_bytes(dtype)
    need_disk = BASE_Q4_K_M_BYTES + N_EXPERTS_TALL * one
    resident = experts_that_fit(ram_bytes, dtype)
    ram_gb, need_gb = ram_bytes / 1e9, (BASE_Q4_K_M_BYTES + one + RUNTIME_OVERHEAD_BYTES) / 1e9
    disk = (
        ""
        if disk_free_bytes is None
        else f"; {disk_free_bytes / 1e9:.0f} GB of disk free, its installed files take {need_disk / 1e9:.0f} GB"
    )
    if resident < 1:
        return False, f"Tall does not fit: {ram_gb:.0f} GB RAM, needs at least {need_gb:.0f} GB ({dtype} experts){disk}"
    if disk_free_bytes is not None and disk_free_bytes < need_disk:
        return False, f"Tall fits in RAM ({resident} of 4 {dtype} experts resident) but not on disk{disk}"
    how = (
        "all 4 experts resident"
        if resident == N_EXPERTS_TALL
        else f"{resident} of 4 experts resident, others on demand"
    )
    return True, f"Tall fits: {ram_gb:.0f} GB RAM, {how} ({dtype}, {one / 1e9:.1f} GB each){disk}"


def machine_ram_bytes() -> int | None:
    """Physical RAM of this machine (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def machine_verdict(models_dir: Path) -> tuple[bool, str]:
    """`verdict` for this machine: its RAM and the free disk where models are stored."""
    ram = machine_ram_bytes()
    if ram is None:
        return False, "cannot tell whether Tall fits: this OS does not report its RAM"
    probe = models_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    return verdict(ram, free)


def adapter_ram_budget(base_path: Path) -> int:
    """Bytes of adapters the engine may keep resident next to this base on this machine (0: no
    limit known): RAM minus the base (mmapped, resident once used) minus the runtime allowance.
    With Tall on a machine where four experts do not fit, the others load on demand."""
    ram = machine_ram_bytes()
    if ram is None:
        return 0
    try:
        base = base_path.stat().st_size
    except OSError:
        return 0
    return max(1, ram - base - RUNTIME_OVERHEAD_BYTES)
