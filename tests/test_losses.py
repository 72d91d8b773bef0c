"""Each loss alone, on tiny hand-made tensors: exact values worked out by hand or with numpy,
the sign (or absence) of gradients, masks, and gradcheck in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from macaron_local.learn.losses import (  # noqa: E402
    dpo_loss,
    excess_nll,
    group_advantages,
    kl_to_reference,
    policy_gradient_loss,
    sequence_logprobs,
    sft_loss,
    truncated_importance_weight,
)

D = torch.float64


def t(values, dtype=D, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


def grad_of(loss_fn, logp: torch.Tensor) -> torch.Tensor:
    logp = logp.detach().clone().requires_grad_(True)
    loss_fn(logp).backward()
    return logp.grad


# ----------------------------------------------------------------- sequence_logprobs
def test_sequence_logprobs_matches_numpy_log_softmax_and_zeroes_padding() -> None:
    logits = np.array([[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [9.0, 9.0, 9.0]]])
    targets = torch.tensor([[1, 2, -100]])  # -100: a padding id that must never be indexed
    mask = torch.tensor([[1, 1, 0]])
    got = sequence_logprobs(torch.tensor(logits), targets, mask)
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert got.shape == (1, 3)
    np.testing.assert_allclose(got[0, :2].numpy(), [log_softmax[0, 0, 1], log_softmax[0, 1, 2]], rtol=1e-12)
    assert got[0, 2].item() == 0.0


def test_sequence_logprobs_takes_a_bool_mask_and_carries_gradient_only_on_valid_tokens() -> None:
    logits = torch.zeros(1, 2, 4, dtype=D, requires_grad=True)
    got = sequence_logprobs(logits, torch.tensor([[3, 0]]), torch.tensor([[True, False]]))
    assert got[0, 0].item() == pytest.approx(-math.log(4))
    got.sum().backward()
    assert torch.all(logits.grad[0, 1] == 0)
    np.testing.assert_allclose(logits.grad[0, 0].numpy(), [-0.25, -0.25, -0.25, 0.75])


# ----------------------------------------------------------------- group_advantages
def test_group_advantages_are_centred_and_scaled_by_the_population_std() -> None:
    got = group_advantages(t([1.0, 2.0, 3.0]), eps=0.0)
    std = math.sqrt(2 / 3)  # population std of 1, 2, 3
    np.testing.assert_allclose(got.numpy(), [-1 / std, 0.0, 1 / std], rtol=1e-12)


def test_group_advantages_per_row_and_all_equal_groups_give_exact_zeros() -> None:
    rewards = t([[0.1, 0.1, 0.1], [0.0, 1.0, 0.0], [0.7, 0.7, 0.7]], dtype=torch.float32)
    got = group_advantages(rewards)
    assert torch.equal(got[0], torch.zeros(3)) and torch.equal(got[2], torch.zeros(3))
    np.testing.assert_allclose(got[1].numpy(), [-1 / math.sqrt(2), math.sqrt(2), -1 / math.sqrt(2)], rtol=1e-5)
    assert torch.equal(group_advantages(t([0.3])), t([0.0]))  # a group of one: nothing to compare


# ----------------------------------------------------------------- policy_gradient_loss
def test_policy_gradient_on_policy_is_minus_the_token_mean_advantage() -> None:
    logp = t([[-1.0, -2.0, -0.5], [-0.3, 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    # token mean over 4 valid tokens: (3 * 1.0 + 1 * 0.0) / 4, not the sequence mean (1 + 0) / 2
    loss = policy_gradient_loss(logp, logp, t([1.0, 0.0]), mask)
    assert loss.item() == pytest.approx(-0.75)
    grad = grad_of(lambda lp: policy_gradient_loss(lp, logp, t([1.0, 0.0]), mask), logp)
    np.testing.assert_allclose(grad.numpy(), [[-0.25, -0.25, -0.25], [0.0, 0.0, 0.0]])


def test_policy_gradient_exact_clipped_values() -> None:
    logp, old, mask = t([[math.log(0.5)]]), t([[math.log(0.4)]]), t([[1]])  # ratio 1.25
    assert policy_gradient_loss(logp, old, t([1.0]), mask).item() == pytest.approx(-1.2)  # clipped at 1 + 0.2
    assert policy_gradient_loss(logp, old, t([-1.0]), mask).item() == pytest.approx(1.25)  # min keeps -1.25
    assert policy_gradient_loss(logp, old, t([1.0]), mask, clip_eps=0.5).item() == pytest.approx(-1.25)


def test_zero_advantages_give_zero_loss_and_zero_gradient() -> None:
    logp, old = t([[-1.0, -2.0]]), t([[-1.5, -1.0]])
    grad = grad_of(lambda lp: policy_gradient_loss(lp, old, t([0.0]), t([[1, 1]])), logp)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize(
    ("log_ratio", "advantage", "stopped", "sign"),
    [
        (0.5, 1.0, True, 0),  # ratio 1.65 > 1.2 and A > 0: already pushed up enough
        (-0.5, 1.0, False, -1),  # ratio 0.61 < 0.8 and A > 0: still pulled up
        (-0.5, -1.0, True, 0),  # ratio 0.61 < 0.8 and A < 0: already pushed down enough
        (0.5, -1.0, False, 1),  # ratio 1.65 > 1.2 and A < 0: still pushed down
        (0.1, 1.0, False, -1),  # inside the trust region: plain policy gradient
    ],
)
def test_clipping_stops_the_gradient_only_beyond_the_trust_region(
    log_ratio: float, advantage: float, stopped: bool, sign: int
) -> None:
    old = t([[-1.0]])
    grad = grad_of(lambda lp: policy_gradient_loss(lp, old, t([advantage]), t([[1]])), old + log_ratio)
    if stopped:
        assert grad.item() == 0.0
    else:
        assert np.sign(grad.item()) == sign
        assert grad.item() == pytest.approx(-advantage * math.exp(log_ratio))  # d(-ratio*A)/dlogp


def test_importance_weight_is_truncated_detached_and_multiplies_the_loss() -> None:
    logp = old = t([[-1.0, -1.0, -1.0]])
    sampler = t([[-1.0 - math.log(5.0), -1.0 + math.log(2.0), 0.0]])  # weights 5 -> 2 (cap), 0.5, pad
    mask = t([[1, 1, 0]])
    weight = truncated_importance_weight(old, sampler, mask)
    np.testing.assert_allclose(weight.numpy(), [[2.0, 0.5, 0.0]], rtol=1e-12)
    assert not weight.requires_grad
    loss = policy_gradient_loss(logp, old, t([1.0]), mask, sampler_logp=sampler)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert policy_gradient_loss(logp, old, t([1.0]), mask, sampler_logp=sampler, is_cap=10.0).item() == pytest.approx(
        -(5.0 + 0.5) / 2
    )
    sampler_leaf = sampler.clone().requires_grad_(True)
    policy_gradient_loss(logp.clone().requires_grad_(True), old, t([1.0]), mask, sampler_logp=sampler_leaf).backward()
    assert sampler_leaf.grad is None or torch.all(sampler_leaf.grad == 0)


def test_padding_garbage_changes_nothing_and_never_makes_nan() -> None:
    old, adv = t([[-1.0, -2.0]]), t([0.7])
    clean = policy_gradient_loss(t([[-1.1, -1.9]]), old, adv, t([[1, 1]]))
    padded_logp = t([[-1.1, -1.9, 1e4, -1e4]], grad=True)
    padded_old = t([[-1.0, -2.0, -1e4, float("inf")]])
    mask = t([[1, 1, 0, 0]])
    loss = policy_gradient_loss(padded_logp, padded_old, adv, mask, sampler_logp=t([[-1.0, -2.0, 1e4, -1e4]]))
    assert loss.item() == pytest.approx(clean.item())
    loss.backward()
    assert torch.isfinite(padded_logp.grad).all() and torch.all(padded_logp.grad[0, 2:] == 0)
    assert policy_gradient_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[0]])).item() == 0.0  # all padding


def test_policy_gradient_gradcheck_float64() -> None:
    old = t([[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.2, -4.0, -1.0]])
    log_ratio = t([[0.05, 0.4, -0.4, -0.1], [0.1, -0.05, 0.3, 0.0]])  # inside and outside the clip range
    logp = (old + log_ratio).requires_grad_(True)
    advantages = t([[1.0, -0.5, 2.0, 0.3], [-1.0, 0.4, -0.7, 0.0]])
    sampler = old - t([[0.1, -0.2, 1.5, 0.0], [0.3, 0.0, -0.4, 0.2]])
    mask = t([[1, 1, 1, 1], [1, 1, 0.5, 0]])

    def loss(lp: torch.Tensor) -> torch.Tensor:
        return policy_gradient_loss(lp, old, advantages, mask, sampler_logp=sampler)

    assert torch.autograd.gradcheck(loss, (logp,))


# ----------------------------------------------------------------- kl_to_reference
def test_kl_is_zero_with_zero_gradient_when_policy_equals_reference() -> None:
    logp = t([[-1.0, -0.2, -3.0]])
    grad = grad_of(lambda lp: kl_to_reference(lp, logp, t([[1, 1, 1]])), logp)
    assert kl_to_reference(logp, logp, t([[1, 1, 1]])).item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


def test_kl_exact_value_and_positive_whenever_they_differ() -> None:
    d = math.log(0.25 / 0.5)
    got = kl_to_reference(t([[math.log(0.5)]]), t([[math.log(0.25)]]), t([[1]]))
    assert got.item() == pytest.approx(math.exp(d) - d - 1)  # 0.5 + ln 2 - 1
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = rng.normal(size=(2, 5)), rng.normal(size=(2, 5))
        assert kl_to_reference(t(a), t(b), torch.ones(2, 5, dtype=D)).item() > 0


def test_kl_k3_weighted_by_the_policy_equals_the_exact_kl() -> None:
    """E_{x~p}[k3] = sum_x p (q/p - log(q/p) - 1) = KL(p || q); a float mask of p computes it."""
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.2, 0.6])
    got = kl_to_reference(t(np.log(p)[None]), t(np.log(q)[None]), t(p[None]))
    assert got.item() == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-12)


def test_kl_ignores_padding() -> None:
    clean = kl_to_reference(t([[-1.0]]), t([[-2.0]]), t([[1]]))
    padded = kl_to_reference(t([[-1.0, 50.0]]), t([[-2.0, -50.0]]), t([[1, 0]]))
    assert padded.item() == pytest.approx(clean.item())


def test_kl_caps_each_token_so_one_far_token_cannot_explode_the_step() -> None:
    """A token the policy pushed 8 nats below the reference: k3 = e^8 - 9, about 2972; capped at 10
    it weighs like any strongly moved token, and it stops pulling (zero gradient)."""
    logp = t([[-9.0, -1.0]], grad=True)
    ref = t([[-1.0, -1.5]])
    mask = t([[1, 1]])
    capped = kl_to_reference(logp, ref, mask)
    uncapped = kl_to_reference(logp, ref, mask, token_cap=None)
    small = math.exp(-0.5) + 0.5 - 1
    assert uncapped.item() == pytest.approx((math.exp(8) - 9 + small) / 2)
    assert capped.item() == pytest.approx((10 + small) / 2)
    capped.backward()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() != 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_token_pushed_past_exps_range_keeps_the_kl_and_its_gradient_finite(dtype) -> None:
    """A disliked reply's token the policy pushed 100 nats below the reference (float32's exp
    overflows past 88, float64's past 709: 800 nats): e^d is inf, the cap's zero gradient times
    inf is NaN, and one NaN step spoiled a ratings night's LoRA (stop 40). Capped before the exp,
    the token weighs the cap and stops pulling, as at 8 nats; the other token still pulls."""
    for far in (100.0, 800.0):
        logp = t([[-1.0 - far, -1.0]], dtype=dtype, grad=True)
        ref = t([[-1.0, -1.5]], dtype=dtype)
        loss = kl_to_reference(logp, ref, t([[1, 1]], dtype=dtype))
        small = math.exp(-0.5) + 0.5 - 1
        assert loss.item() == pytest.approx((10 + small) / 2, rel=1e-6)
        loss.backward()
        assert torch.isfinite(logp.grad).all()
        assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() != 0.0


def test_kl_gradcheck_float64() -> None:
    ref = t([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
    logp = (ref + t([[0.3, -0.7, 0.0], [1.2, 0.1, -0.4]])).requires_grad_(True)
    mask = t([[1, 1, 1], [1, 0.5, 0]])
    assert torch.autograd.gradcheck(lambda lp: kl_to_reference(lp, ref, mask), (logp,))


# ----------------------------------------------------------------- sft_loss
def test_sft_is_the_mean_nll_over_valid_tokens() -> None:
    logp = t([[-1.0, -2.0, -7.0], [-3.0, -100.0, -100.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    assert sft_loss(logp, mask).item() == pytest.approx(2.0)
    grad = grad_of(lambda lp: sft_loss(lp, mask), logp)
    np.testing.assert_allclose(grad.numpy(), -mask.numpy() / 3)


# ----------------------------------------------------------------- excess_nll
def test_excess_nll_counts_only_what_the_policy_lost_against_the_reference() -> None:
    ref = t([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]])
    logp = t([[-1.5, -1.0, -3.0], [-2.5, 50.0, -100.0]])  # lost 0.5, gained 1, equal; lost 2; padding
    mask = t([[1, 1, 1], [1, 0, 0]])
    assert excess_nll(logp, ref, mask).item() == pytest.approx((0.5 + 0.0 + 0.0 + 2.0) / 4)
    grad = grad_of(lambda lp: excess_nll(lp, ref, mask), logp)
    # a lost token is pulled back up (descent raises logp); a gained or padded one is left alone
    np.testing.assert_allclose(grad.numpy(), [[-0.25, 0.0, 0.0], [-0.25, 0.0, 0.0]])


def test_excess_nll_at_the_reference_is_zero_with_zero_gradient_and_the_reference_is_detached() -> None:
    """On a night's first step the policy is the reference on every passage token: the term must
    not start out as plain NLL (a clip's subgradient at 0 would make it one)."""
    ref = t([[-1.0, -2.0]], grad=True)
    logp = t([[-1.0, -2.0]], grad=True)
    loss = excess_nll(logp, ref, t([[1, 1]]))
    loss.backward()
    assert loss.item() == 0.0
    assert ref.grad is None
    assert not logp.grad.any()


# ----------------------------------------------------------------- dpo_loss
def test_dpo_exact_values() -> None:
    zero = t([0.0])
    assert dpo_loss(zero, zero, zero, zero).item() == pytest.approx(math.log(2))
    # margin = (-10 - -12) - (-9 - -8) = 3; loss = -log sigmoid(0.1 * 3) = log(1 + e^-0.3)
    got = dpo_loss(t([-10.0, -10.0]), t([-9.0, -9.0]), t([-12.0, -12.0]), t([-8.0, -8.0]))
    assert got.item() == pytest.approx(math.log1p(math.exp(-0.3)))
    assert dpo_loss(t([-10.0]), t([-9.0]), t([-12.0]), t([-8.0]), beta=1.0).item() == pytest.approx(
        math.log1p(math.exp(-3.0))
    )


def test_dpo_decreases_as_the_chosen_margin_grows_and_gradients_point_that_way() -> None:
    ref_c, ref_r, rejected = t([-5.0]), t([-5.0]), t([-5.0])
    losses = [dpo_loss(t([c]), rejected, ref_c, ref_r).item() for c in (-8.0, -5.0, -2.0, 1.0)]
    assert losses == sorted(losses, reverse=True) and len(set(losses)) == 4
    chosen, rej = t([-5.0], grad=True), t([-5.0], grad=True)
    ref_c_leaf = t([-5.0], grad=True)
    dpo_loss(chosen, rej, ref_c_leaf, ref_r).backward()
    assert chosen.grad.item() == pytest.approx(-0.05)  # -beta * sigmoid(0) : raise the chosen
    assert rej.grad.item() == pytest.approx(0.05)  # lower the rejected
    assert ref_c_leaf.grad is None  # the reference is a fixed anchor


# ----------------------------------------------------------------- plain NumPy
def test_numpy_arrays_give_the_torch_values_with_no_gradient() -> None:
    """What is computed on the machine and not trained through (a remote trainer's advantages)
    runs the same losses on NumPy arrays."""
    rng = np.random.default_rng(5)
    logp = np.log(rng.uniform(0.05, 0.9, (3, 4)))
    ref, sampler = logp + rng.normal(0, 0.5, (3, 4)), logp + rng.normal(0, 0.8, (3, 4))
    mask = np.array([[0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=np.float64)
    advantages = np.array([1.2, -0.4, 0.0])
    cases = {
        "policy_gradient": lambda x, r, s, m, a: policy_gradient_loss(x, x, a, m, 0.2, sampler_logp=s),
        "kl": lambda x, r, s, m, a: kl_to_reference(x, r, m),
        "sft": lambda x, r, s, m, a: sft_loss(x, m),
        "excess_nll": lambda x, r, s, m, a: excess_nll(x, r, m),
    }
    for name, case in cases.items():
        ours = case(logp, ref, sampler, mask, advantages)
        theirs = case(*(t(v) for v in (logp, ref, sampler, mask, advantages)))
        assert float(ours) == pytest.approx(float(theirs), rel=1e-9), name
    rewards = np.array([[0.1, 0.5, 0.9], [1.0, 1.0, 1.0]])
    np.testing.assert_allclose(group_advantages(rewards), group_advantages(t(rewards)).numpy(), rtol=1e-12)
    logits = rng.normal(0, 2, (1, 3, 5))
    targets = np.array([[1, 4, 0]])
    np.testing.assert_allclose(
        sequence_logprobs(logits, targets, np.ones((1, 3), dtype=bool)),
        sequence_logprobs(t(logits), torch.tensor(targets), torch.ones(1, 3, dtype=torch.bool)).numpy(),
        rtol=1e-12,
    )


def test_a_remote_trainer_is_sent_each_groups_advantages_whatever_its_size() -> None:
    from macaron_local.learn.remote_run import advantages_of

    got = advantages_of([[1.0, 0.0, 0.5], [0.2, 0.2], [-1.0, 0.0, -1.0, -1.0, 0.5]])
    assert [len(g) for g in got] == [3, 2, 5] and got[1] == [0.0, 0.0]
    np.testing.assert_allclose(got[0], [math.sqrt(1.5), -math.sqrt(1.5), 0.0], rtol=1e-5)  # eps in the divisor
    assert sum(got[2]) == pytest.approx(0.0, abs=1e-9)
