"""A tiny random Qwen3.5-MoE (`qwen3_5_moe`, GGUF `qwen35moe`) built with transformers, and its GGUF.

Tall's base is far too big for tests, so this builds the same architecture at toy size with
transformers itself (float32): Gated DeltaNet and gated full-attention layers, 8 routed experts
(top 2) and a sigmoid-gated shared expert. `write_base_gguf` is this project's own HF -> GGUF
writer for it, following the layout in `macaron_local.adapters.qwen35moe` (read from llama.cpp's
convert_hf_to_gguf.py), so llama.cpp's logits can be compared with transformers' directly.

Everything is built in a second or two and cached per test session by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from tinymodels import BOS_ID, CHATML_TEMPLATE, EOS_ID, SPECIAL_TOKENS, _vocab

from macaron_local.adapters.qwen35moe import (
    LinearAttentionDims,
    linear_attn_rows,
    out_proj_columns,
    split_gate_up,
    v_head_order,
)

N_VOCAB = 64
HIDDEN = 64
LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "full_attention")
N_EXPERTS = 8
TOP_K = 2
MOE_FF = 32
SHARED_FF = 64
HEAD_DIM = 16
ROTARY = 0.25
MROPE_SECTION = (1, 1, 0)  # sums to head_dim * ROTARY / 2
#: Every kind of module Macaron trains on Tall, grouped the way the parity tests switch them on.
TARGET_GROUPS: dict[str, tuple[str, ...]] = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "linear_attention": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    "shared_expert": (
        "shared_expert.gate_proj",
        "shared_expert.up_proj",
        "shared_expert.down_proj",
        "shared_expert_gate",
    ),
}
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def byte_vocab() -> tuple[list[str], list[str]]:
    """A gpt2-style vocabulary that can spell any text: the specials, all 256 byte symbols and a
    handful of merges (llama.cpp wants at least one). For tests that feed real prompts (the
    protocol's route instruction, chat markup) rather than token ids."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    merges = ["Ġ t", "Ġ a", "e r", "i n", "o n"]
    return [*SPECIAL_TOKENS, *symbols, *(m.replace(" ", "") for m in merges)], merges


N_BYTE_VOCAB = len(byte_vocab()[0])

#: A Qwen3-style chat template of our own writing, enough for the protocol's paths: tool results
#: as user turns wrapped in <tool_response>, and the final assistant message (a prefill the model
#: continues, as the route hop's `model_id=`) after an empty thinking block, as Qwen3's
#: templates render the turn that follows the last user query.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' -}}"
    "{%- elif message['role'] == 'assistant' and loop.last and not add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def hf_config(n_vocab: int = N_VOCAB, context: int = 256):
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=n_vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # != key heads, so the V-head reorder is exercised
        moe_intermediate_size=MOE_FF,
        shared_expert_intermediate_size=SHARED_FF,
        num_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K,
        rms_norm_eps=1e-6,
        max_position_embeddings=context,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": ROTARY,
            "mrope_section": list(MROPE_SECTION),
            "mrope_interleaved": True,
        },
    )
    config._attn_implementation = "eager"
    return config


def build_hf_model(seed: int = 0, *, n_vocab: int = N_VOCAB, context: int = 256):
    """A `Qwen3_5MoeForCausalLM` with random weights at scales that keep activations O(1) and
    logits spread by a few units, so differences between engines show."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(hf_config(n_vocab, context)).float().eval()
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if name.endswith("linear_attn.norm.weight"):
                value = 1.0 + normal(shape, 0.1)  # a plain (not zero-centred) RMSNorm
            elif name.endswith("norm.weight"):
                value = normal(shape, 0.1)  # zero-centred: the model multiplies by 1 + w
            elif name.endswith("A_log"):
                value = torch.rand(shape, generator=gen) * 2 - 1
            elif name.endswith(("dt_bias", "embed_tokens.weight")) or "conv1d" in name:
                value = normal(shape, 0.5)
            elif name.endswith("mlp.gate.weight"):
                value = normal(shape, 3.0 / np.sqrt(shape[-1]))  # decisive routing
            else:
                value = normal(shape, 1.0 / np.sqrt(shape[-1]))
            param.copy_(value)
    return model


def linear_dims(config) -> LinearAttentionDims:
    assert config.linear_key_head_dim == config.linear_value_head_dim
    return LinearAttentionDims(config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim)


def gguf_tensors(model, fuse_gate_up: bool = False) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names and in GGUF layout (numpy order); `fuse_gate_up`
    keeps one `ffn_gate_up_exps` per layer, as convert_hf_to_gguf.py --fuse-gate-up-exps does."""
    config = model.config
    dims = linear_dims(config)
    out: dict[str, np.ndarray] = {}
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out["token_embd.weight"] = state.pop("model.embed_tokens.weight")
    out["output.weight"] = state.pop("lm_head.weight")
    out["output_norm.weight"] = state.pop("model.norm.weight") + 1
    v_order_1 = v_head_order(dims.n_k_heads, dims.n_v_heads, 1)
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = state.pop(p + "input_layernorm.weight") + 1
        out[b + "post_attention_norm.weight"] = state.pop(p + "post_attention_layernorm.weight") + 1
        if config.layer_types[i] == "full_attention":
            a = p + "self_attn."
            for hf, name in (
                ("q_proj", "attn_q"),
                ("k_proj", "attn_k"),
                ("v_proj", "attn_v"),
                ("o_proj", "attn_output"),
            ):
                out[b + name + ".weight"] = state.pop(a + hf + ".weight")
            out[b + "attn_q_norm.weight"] = state.pop(a + "q_norm.weight") + 1
            out[b + "attn_k_norm.weight"] = state.pop(a + "k_norm.weight") + 1
        else:
            a = p + "linear_attn."
            for hf, name in (
                ("in_proj_qkv", "attn_qkv"),
                ("in_proj_z", "attn_gate"),
                ("in_proj_b", "ssm_beta"),
                ("in_proj_a", "ssm_alpha"),
            ):
                w = state.pop(a + hf + ".weight")
                rows = linear_attn_rows(hf, dims)
                out[b + name + ".weight"] = w if rows is None else w[rows]
            cols = out_proj_columns(dims)
            w = state.pop(a + "out_proj.weight")
            out[b + "ssm_out.weight"] = w if cols is None else w[:, cols]
            out[b + "ssm_a"] = (-np.exp(state.pop(a + "A_log")))[v_order_1]
            out[b + "ssm_dt.bias"] = state.pop(a + "dt_bias")[v_order_1]
            conv = state.pop(a + "conv1d.weight").squeeze(1)  # (channels, kernel)
            qk = 2 * dims.key_dim
            v_rows = v_head_order(dims.n_k_heads, dims.n_v_heads, dims.head_dim)
            out[b + "ssm_conv1d.weight"] = np.concatenate([conv[:qk], conv[qk:][v_rows]])
            out[b + "ssm_norm.weight"] = state.pop(a + "norm.weight")
        m = p + "mlp."
        out[b + "ffn_gate_inp.weight"] = state.pop(m + "gate.weight")
        gate_up = state.pop(m + "experts.gate_up_proj")
        if fuse_gate_up:
            out[b + "ffn_gate_up_exps.weight"] = gate_up
        else:
            out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = split_gate_up(gate_up)
        out[b + "ffn_down_exps.weight"] = state.pop(m + "experts.down_proj")
        for hf, name in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
            out[b + name + ".weight"] = state.pop(m + "shared_expert." + hf + ".weight")
        out[b + "ffn_gate_inp_shexp.weight"] = state.pop(m + "shared_expert_gate.weight")
    if state:
        raise ValueError(f"HF tensors not placed in the GGUF: {sorted(state)}")
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def write_base_gguf(
    model, path: str | Path, fuse_gate_up: bool = False, *, chat_template: str = CHATML_TEMPLATE
) -> Path:
    """Write `model` as a `qwen35moe` GGUF base with a small BPE tokenizer (the byte-level one
    when the model has N_BYTE_VOCAB tokens) and a chat template."""
    path = Path(path)
    c = model.config
    dims = linear_dims(c)
    writer = gguf.GGUFWriter(str(path), "qwen35moe")
    writer.add_name("tiny-qwen35moe")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(int(c.head_dim * ROTARY))
    writer.add_rope_dimension_sections([*MROPE_SECTION, 0])
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(dims.head_dim)
    writer.add_ssm_group_count(dims.n_k_heads)
    writer.add_ssm_time_step_rank(dims.n_v_heads)
    writer.add_ssm_inner_size(dims.value_dim)
    interval = LAYER_TYPES.index("full_attention") + 1
    assert all((t == "full_attention") == ((i + 1) % interval == 0) for i, t in enumerate(LAYER_TYPES))
    writer.add_full_attention_interval(interval)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens, merges = byte_vocab() if c.vocab_size == N_BYTE_VOCAB else _vocab(c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i < len(SPECIAL_TOKENS) else gguf.TokenType.NORMAL for i in range(len(tokens))]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)
    for name, values in gguf_tensors(model, fuse_gate_up).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    """Transformers' logits (n_tokens, n_vocab) in float32, whatever adapter `model` carries."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def add_random_lora(model, rank: int, seed: int, *, groups: tuple[str, ...], experts: bool, alpha: float | None = None):
    """Wrap `model` in a PEFT LoRA on the given target groups (and the routed experts in PEFT's
    own packed 3-D layout), with random A and B (PEFT initialises B to zero)."""
    import torch
    from peft import LoraConfig, get_peft_model

    modules = [m for g in groups for m in TARGET_GROUPS[g]]
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=modules or None,
        target_parameters=list(EXPERT_PARAMETERS) if experts else None,
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / np.sqrt(param.shape[-1]))
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5 / np.sqrt(rank))
    return peft_model.eval()


@dataclass
class TinyQwen35Moe:
    """The HF model (for the reference) and its base GGUF (for llama.cpp)."""

    model: object
    gguf_path: Path


def build(directory: str | Path, seed: int = 0) -> TinyQwen35Moe:
    model = build_hf_model(seed)
    return TinyQwen35Moe(model=model, gguf_path=write_base_gguf(model, Path(directory) / "tiny-qwen35moe.gguf"))
