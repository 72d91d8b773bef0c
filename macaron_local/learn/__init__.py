"""Nightly learning: turn the user's corrections into LoRA updates.

- `episodes`: read the store into episodes (prompt, chosen and/or rejected reply, expert slot).
- `rewards`: score sampled replies against an episode (chrF towards the chosen, away from the
  rejected; regex checks).
- `losses`: the objectives as pure tensor functions (clipped policy gradient with group
  advantages and a sampler/trainer importance weight, KL to the reference, SFT, DPO).
- `backends`: the trainers those losses run in.
- `gate`, `retention`: whether a candidate may replace what is served (`retention`: the tokens
  earlier nights taught stay likely).

torch is an optional extra (`macaron-local[torch]`), so the loss names are imported on first
use: reading episodes or scoring rewards never needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from macaron_local.learn.episodes import Episode, episodes_from_store
from macaron_local.learn.rewards import chrf, preference_reward, regex_reward, token_f1

if TYPE_CHECKING:
    from macaron_local.learn.losses import (
        dpo_loss,
        group_advantages,
        kl_to_reference,
        policy_gradient_loss,
        sequence_logprobs,
        sft_loss,
        truncated_importance_weight,
    )

_LOSSES = (
    "dpo_loss",
    "group_advantages",
    "kl_to_reference",
    "policy_gradient_loss",
    "sequence_logprobs",
    "sft_loss",
    "truncated_importance_weight",
)

__all__ = [
    "Episode",
    "chrf",
    "dpo_loss",
    "episodes_from_store",
    "group_advantages",
    "kl_to_reference",
    "policy_gradient_loss",
    "preference_reward",
    "regex_reward",
    "sequence_logprobs",
    "sft_loss",
    "token_f1",
    "truncated_importance_weight",
]


def __getattr__(name: str) -> Any:
    if name in _LOSSES:
        return getattr(importlib.import_module("macaron_local.learn.losses"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
