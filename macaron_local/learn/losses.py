"""The learning objectives, as pure functions of arrays: no model, no I/O, so each one is
tested on a few hand-made numbers and any backend can call it. They take torch tensors or MLX
arrays alike (`arrays.ops_for` supplies the library's spelling of each operation).

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

from typing import Any

from macaron_local.learn.arrays import ops_for

Array = Any  # a torch.Tensor or an mlx.core.array

#: |log(ref / policy)| a token's KL term is computed at, at most (`kl_to_reference`).
KL_LOG_RATIO_LIMIT = 20.0


def _valid(mask: Array) -> Array:
    return mask != 0


def _token_mean(values: Array, mask: Array) -> Array:
    """sum(mask * values) / sum(mask), with masked values dropped (not multiplied: 0 * inf is NaN).
    An all-padding batch gives 0 rather than 0 / 0."""
    ops = ops_for(values)
    weights = ops.cast_like(mask, values)
    total = ops.where(_valid(mask), values * weights, ops.zeros_like(values)).sum()
    return total / ops.clip(weights.sum(), 1.0, None)


def sequence_logprobs(logits: Array, targets: Array, mask: Array) -> Array:
    """Per-token log-probabilities of `targets`: log_softmax(logits)[b, t, targets[b, t]].

    logits (B, T, V) are already aligned with targets (B, T): logits[:, t] predicts targets[:, t]
    (shift by one before calling). Masked positions come back as exactly 0, and their target ids
    are never used as indices, so padding with -100 is fine.
    """
    ops = ops_for(logits)
    valid = _valid(mask)
    safe_targets = ops.where(valid, targets, ops.zeros_like(targets))
    logp = ops.take_last_axis(ops.log_softmax(logits, axis=-1), safe_targets)
    return ops.where(valid, logp, ops.zeros_like(logp))


def group_advantages(rewards: Array, eps: float = 1e-6) -> Array:
    """GRPO advantages: A_i = (r_i - mean(r)) / (std(r) + eps) within each group (the last axis).

    rewards is (G,) for one group or (B, G) for B groups of G samples of the same prompt. The std
    is the population one (divide by G), so a group of one is defined (and gets 0). A group whose
    rewards are all equal carries no preference between its samples: it gets exactly 0, not the
    rounding noise of r - mean(r) divided by eps.
    """
    ops = ops_for(rewards)
    centred = rewards - ops.mean(rewards, axis=-1, keepdims=True)
    std = ops.std(rewards, axis=-1, keepdims=True)
    advantages = centred / (std + eps)
    all_equal = ops.all(rewards == rewards[..., :1], axis=-1, keepdims=True)
    return ops.where(all_equal, ops.zeros_like(advantages), advantages)


def policy_gradient_loss(
    logp: Array,
    logp_old: Array,
    advantages: Array,
    mask: Array,
    clip_eps: float = 0.2,
    sampler_logp: Array | None = None,
    is_cap: float = 2.0,
) -> Array:
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
    ops = ops_for(logp)
    valid = _valid(mask)
    if advantages.ndim == logp.ndim - 1:
        advantages = ops.expand_dims(advantages, -1)
    advantages = ops.broadcast_like(ops.cast_like(ops.stop_gradient(advantages), logp), logp)
    log_ratio = ops.where(valid, logp - ops.stop_gradient(logp_old), ops.zeros_like(logp))
    ratio = ops.exp(log_ratio)
    clipped = ops.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = -ops.minimum(ratio * advantages, clipped * advantages)
    if sampler_logp is not None:
        per_token = per_token * truncated_importance_weight(logp_old, sampler_logp, mask, is_cap)
    return _token_mean(per_token, mask)


def truncated_importance_weight(logp_old: Array, sampler_logp: Array, mask: Array, is_cap: float = 2.0) -> Array:
    """w_t = min(exp(logp_old_t - sampler_logp_t), is_cap), detached; 0 on masked positions.

    The trainer/sampler correction `policy_gradient_loss` applies; exposed so a trainer can
    log how often the cap is hit (a sign the exported adapter and the trainer disagree).
    """
    ops = ops_for(logp_old)
    valid = _valid(mask)
    log_w = ops.where(valid, ops.stop_gradient(logp_old) - ops.stop_gradient(sampler_logp), ops.zeros_like(logp_old))
    weight = ops.clip(ops.exp(log_w), None, is_cap)
    return ops.cast_like(ops.where(valid, weight, ops.zeros_like(weight)), logp_old)


def kl_to_reference(logp: Array, logp_ref: Array, mask: Array, token_cap: float | None = 10.0) -> Array:
    """KL(policy || reference), the k3 estimator on the policy's own tokens, token mean:

        d_t = logp_ref_t - logp_t,    k3_t = exp(d_t) - d_t - 1  (>= 0, = 0 iff d_t = 0)

    k3 is unbiased for KL(pi || ref) on samples from pi and, unlike the plain d_t, never
    negative, so a single token cannot reward moving away from the reference. The reference
    is the base (plus the previous adapter) and is detached: it is a fixed anchor.

    k3 grows like exp(d): one sampled token the policy has since pushed far below the reference
    (d = 6 gives 397) can dominate a whole step; that is the loss spike seen in long runs. Each
    token's term is capped at `token_cap` (verl's "low_var_kl" does the same), so such a token
    stops pulling rather than exploding. d itself is bounded at `KL_LOG_RATIO_LIMIT` first, so
    even uncapped (`token_cap=None`) a term is at most e^20.
    """
    ops = ops_for(logp)
    valid = _valid(mask)
    d = ops.where(valid, ops.stop_gradient(logp_ref) - logp, ops.zeros_like(logp))
    # Bounded before the exp, as verl bounds it: past float32's exp range (d > 88, a disliked
    # reply's token pushed far down) e^d is inf, and the cap's zero gradient times inf is NaN.
    # Within the bound k3 is as written, and past it (k3 >= 19) the cap has already taken over.
    d = ops.clip(d, -KL_LOG_RATIO_LIMIT, KL_LOG_RATIO_LIMIT)
    k3 = ops.exp(d) - d - 1.0
    return _token_mean(k3 if token_cap is None else ops.clip(k3, None, token_cap), mask)


def sft_loss(logp: Array, mask: Array) -> Array:
    """Supervised fine-tuning: mean negative log-likelihood over valid tokens, -sum(mask*logp)/sum(mask).

    Used on a correction directly: the one signal that still teaches when the policy never
    samples anything close to what the user wanted (every group reward equal, advantage 0).
    """
    return _token_mean(-logp, mask)


def dpo_loss(
    chosen_logp: Array,
    rejected_logp: Array,
    ref_chosen_logp: Array,
    ref_rejected_logp: Array,
    beta: float = 0.1,
) -> Array:
    """Direct preference optimisation on (chosen, rejected) pairs, mean over pairs:

        loss = -log sigmoid(beta * ((c - ref_c) - (r - ref_r)))

    All four are (B,) sequence log-probabilities: sums of a reply's token log-probabilities
    (`sequence_logprobs(...).sum(-1)`). A correction is such a pair: the user's edit is
    chosen, the original reply rejected. The reference terms are detached.
    """
    ops = ops_for(chosen_logp)
    margin = (chosen_logp - ops.stop_gradient(ref_chosen_logp)) - (rejected_logp - ops.stop_gradient(ref_rejected_logp))
    return -ops.log_sigmoid(beta * margin).mean()


def excess_nll(logp: Array, logp_ref: Array, mask: Array) -> Array:
    """How much less likely the policy makes text than the reference does, token mean:

        loss_t = max(0, logp_ref_t - logp_t)

    On plain text the user never wrote (learn/passages.py), taken against the bare experts: a
    token the adapter made less likely costs what it lost, and one it made more likely costs
    nothing. The one-sided form keeps the language model where it was without rewarding the
    adapter for memorising the passages (plain NLL would). The reference is detached.
    """
    ops = ops_for(logp)
    valid = _valid(mask)
    lost = ops.where(valid, ops.stop_gradient(logp_ref) - logp, ops.zeros_like(logp))
    # where, not clip: at exactly the reference (every token, on a night's first step) the
    # subgradient must be 0, or the term starts out as plain NLL on the passages
    return _token_mean(ops.where(lost > 0, lost, ops.zeros_like(lost)), mask)
