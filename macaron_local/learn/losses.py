"""The learning objectives, as pure functions of tensors: no model, no I/O, so each one is
tested on a few hand-made numbers and any backend can call it.

Shapes: B sequences of T tokens. `logp` tensors are per-token log-probabilities of the tokens
actually in the sequence, (B, T), as `sequence_logprobs` returns them. `mask` is (B, T), 1 on
the reply's tokens and 0 on the prompt and padding; a float mask may also weigh tokens.

Every token-level loss is a *token mean over the whole batch*: sum over valid tokens divided by
the number of valid tokens. A per-sequence mean first (GRPO's original form) gives each token
of a short reply more weight than a token of a long one, which biases learning towards length
(Dr. GRPO, DAPO); the token mean weighs every token the same.

Masked positions may hold anything (padding ids, -inf, garbage): they are replaced by 0 before
any `exp`, so they can never turn the loss or its gradient into NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask != 0


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(mask * values) / sum(mask), with masked values dropped (not multiplied: 0 * inf is NaN).
    An all-padding batch gives 0 rather than 0 / 0."""
    weights = mask.to(values.dtype)
    total = torch.where(_valid(mask), values * weights, torch.zeros_like(values)).sum()
    return total / weights.sum().clamp(min=1.0)


def sequence_logprobs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token log-probabilities of `targets`: log_softmax(logits)[b, t, targets[b, t]].

    logits (B, T, V) are already aligned with targets (B, T): logits[:, t] predicts targets[:, t]
    (shift by one before calling). Masked positions come back as exactly 0, and their target ids
    are never used as indices, so padding with -100 is fine.
    """
    valid = _valid(mask)
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    logp = torch.log_softmax(logits, dim=-1).gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, logp, torch.zeros_like(logp))


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: A_i = (r_i - mean(r)) / (std(r) + eps) within each group (the last axis).

    rewards is (G,) for one group or (B, G) for B groups of G samples of the same prompt. The std
    is the population one (divide by G), so a group of one is defined (and gets 0). A group whose
    rewards are all equal carries no preference between its samples: it gets exactly 0, not the
    rounding noise of r - mean(r) divided by eps.
    """
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, correction=0, keepdim=True)
    advantages = centred / (std + eps)
    all_equal = (rewards == rewards[..., :1]).all(dim=-1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(advantages), advantages)


def policy_gradient_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    sampler_logp: torch.Tensor | None = None,
    is_cap: float = 2.0,
) -> torch.Tensor:
    """PPO/GRPO clipped surrogate, token mean over the batch (to minimise):

        ratio_t = exp(logp_t - logp_old_t)
        loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - clip_eps, 1 + clip_eps) * A)  [* w_t]
        w_t     = min(exp(logp_old_t - sampler_logp_t), is_cap)                      (detached)

    `logp` carries the gradient; `logp_old` is the trainer's log-probability under the policy
    that produced the samples (equal to `logp.detach()` on the first step over a batch), and is
    detached here. `advantages` is (B,) per sequence or (B, T) per token.

    The min with the clipped term stops the gradient once the ratio has moved past 1 + clip_eps
    for a positive advantage (or 1 - clip_eps for a negative one): one batch cannot push the
    policy far. The samples come from llama.cpp running a quantized model, while the trainer
    runs a dequantized one, so the trainer's own logp_old is not quite the sampling
    distribution; when `sampler_logp` is given, each token is reweighted by the truncated
    importance weight w_t (TIS). Truncating at `is_cap` bounds the variance, in particular for
    off-policy tokens such as a user's correction, which the sampler would rarely produce.
    """
    valid = _valid(mask)
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.detach().to(logp.dtype).expand_as(logp)
    log_ratio = torch.where(valid, logp - logp_old.detach(), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if sampler_logp is not None:
        per_token = per_token * truncated_importance_weight(logp_old, sampler_logp, mask, is_cap)
    return _token_mean(per_token, mask)


def truncated_importance_weight(
    logp_old: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, is_cap: float = 2.0
) -> torch.Tensor:
    """w_t = min(exp(logp_old_t - sampler_logp_t), is_cap), detached; 0 on masked positions.

    The trainer/sampler correction `policy_gradient_loss` applies; exposed so a trainer can
    log how often the cap is hit (a sign the exported adapter and the trainer disagree).
    """
    valid = _valid(mask)
    log_w = torch.where(valid, logp_old.detach() - sampler_logp.detach(), torch.zeros_like(logp_old))
    weight = torch.exp(log_w).clamp(max=is_cap)
    return torch.where(valid, weight, torch.zeros_like(weight)).to(logp_old.dtype)


def kl_to_reference(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(policy || reference), the k3 estimator on the policy's own tokens, token mean:

        d_t = logp_ref_t - logp_t,    k3_t = exp(d_t) - d_t - 1  (>= 0, = 0 iff d_t = 0)

    k3 is unbiased for KL(pi || ref) on samples from pi and, unlike the plain d_t, never
    negative, so a single token cannot reward moving away from the reference. The reference
    is the base (plus the previous adapter) and is detached: it is a fixed anchor.
    """
    valid = _valid(mask)
    d = torch.where(valid, logp_ref.detach() - logp, torch.zeros_like(logp))
    return _token_mean(torch.exp(d) - d - 1.0, mask)


def sft_loss(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning: mean negative log-likelihood over valid tokens, -sum(mask*logp)/sum(mask).

    Used on a correction directly: the one signal that still teaches when the policy never
    samples anything close to what the user wanted (every group reward equal, advantage 0).
    """
    return _token_mean(-logp, mask)


def dpo_loss(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    beta: float = 0.1,
) -> torch.Tensor:
    """Direct preference optimisation on (chosen, rejected) pairs, mean over pairs:

        loss = -log sigmoid(beta * ((c - ref_c) - (r - ref_r)))

    All four are (B,) sequence log-probabilities: sums of a reply's token log-probabilities
    (`sequence_logprobs(...).sum(-1)`). A correction is such a pair: the user's edit is
    chosen, the original reply rejected. The reference terms are detached.
    """
    margin = (chosen_logp - ref_chosen_logp.detach()) - (rejected_logp - ref_rejected_logp.detach())
    return -F.logsigmoid(beta * margin).mean()
