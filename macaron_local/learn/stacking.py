"""The personal adapter trains on top of a frozen expert kept as a LoRA (stacked), as on Tall.

Folding the expert's deltas into the base (`gguf_weights.frozen_deltas`) is exact and cheap for
a small dense float base, and stays the path there. It cannot work for Tall: the trainer's base
is quantized (4-bit MLX, NF4/int8 on a small GPU), so there are no float weights to add to, and
a dense delta for every routed expert would be 3.7B parameters of float32 on top of the base.
So for `qwen3_5_moe` the trainer holds the expert as a second, frozen LoRA read from the same
PEFT files the engine's GGUF was converted from, and the personal LoRA is summed with it:
y = W x + s_e B_e A_e x + s_p B_p A_p x, what llama.cpp computes with both adapters set.

Personal adapter targets on Tall (`PERSONAL_TARGETS`): every linear layer except the routed
experts and the output head, i.e. full-attention q/k/v/o, the Gated DeltaNet projections
(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj) and the shared expert with its gate.
Why: at rank 16 that is about 22M parameters (90 MB in float32, 270 MB with AdamW's state), while
rank 16 on the 256 routed experts of 40 layers adds about 1.26B more (15 GB with AdamW), 56 times
the rest, for experts that each see about 8/256 of the tokens of a night's few thousand: most
of those parameters would get almost no gradient. "LoRA Without Regret" finds the MLP matters
most for LoRA; the shared expert is the MLP every token goes through, so it is kept. Rank 16
(alpha 32, `LearnConfig`): an RL night carries few bits and rank costs memory linearly, but
three lessons on one night crowded rank 8 on the embedded model. Routed experts stay out until
a measurement on Tall shows they are worth it.
"""

from __future__ import annotations

from pathlib import Path

from macaron_local.adapters.peft import CONFIG_FILE, WEIGHTS_FILE
from macaron_local.errors import ModelError

#: Model types whose trainer stacks the expert instead of folding it.
STACKED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
#: The personal adapter's modules on Tall (peft `target_modules` suffixes).
PERSONAL_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
    "shared_expert.gate_proj",
    "shared_expert.up_proj",
    "shared_expert.down_proj",
    "shared_expert_gate",
)


def stacks_experts(model_type: str) -> bool:
    return model_type in STACKED_MODEL_TYPES


def personal_targets(model_type: str) -> str | list[str]:
    """peft `target_modules` for the personal adapter: Tall's list, or every linear layer."""
    return list(PERSONAL_TARGETS) if stacks_experts(model_type) else "all-linear"


def peft_source(directory: Path) -> Path | None:
    """`directory` when it is a complete PEFT adapter directory, else None."""
    directory = Path(directory)
    return directory if (directory / CONFIG_FILE).is_file() and (directory / WEIGHTS_FILE).is_file() else None


def expert_trainer_source(catalog, manifest, slot: str) -> Path | None:
    """The PEFT directory the engine's GGUF expert for `slot` was converted from (None when the
    expert ships as GGUF only, or the slot has no expert)."""
    expert = manifest.experts.get(slot)
    if expert is None or expert.source is None or expert.source.format != "peft":
        return None
    src = expert.source
    if src.kind == "huggingface":
        return peft_source(catalog.model_dir(manifest) / src.subfolder)
    return peft_source(catalog.source_path(manifest, src))


def stacked_source(sources: dict[str, Path | None], group: str) -> Path | None:
    """The PEFT directory to stack for an episode group (the expert's GGUF path; "" = none)."""
    if not group:
        return None
    source = sources.get(group)
    if source is None:
        raise ModelError(
            f"the trainer stacks the expert served from {Path(group).name} and needs the PEFT files it was "
            "converted from (an expert shipped as GGUF only cannot be trained on with this model)"
        )
    return source
