"""The losses are written once for every array library: on the same numbers, MLX arrays and
torch tensors give the same value and the same gradient (value and gradient are what a trainer
backend consumes)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core")

from macaron_local.learn import losses  # noqa: E402

RNG = np.random.default_rng(3)
B, T, V = 3, 5, 7
LOGP = np.log(RNG.uniform(0.05, 0.9, (B, T)))
OLD = LOGP + RNG.normal(0, 0.3, (B, T))
SAMPLER = LOGP + RNG.normal(0, 0.8, (B, T))
REF = LOGP + RNG.normal(0, 0.5, (B, T))
MASK = np.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=np.float32)
ADV = np.array([1.2, -0.4, 0.0])
LOGITS = RNG.normal(0, 2, (B, T, V))
TARGETS = RNG.integers(0, V, (B, T))

CASES = {
    "policy_gradient": lambda x, a, m, o, s, r: losses.policy_gradient_loss(x, o, a, m, 0.2, sampler_logp=s),
    "kl": lambda x, a, m, o, s, r: losses.kl_to_reference(x, r, m),
    "sft": lambda x, a, m, o, s, r: losses.sft_loss(x, m),
    "excess_nll": lambda x, a, m, o, s, r: losses.excess_nll(x, r, m),
    "dpo": lambda x, a, m, o, s, r: losses.dpo_loss(x.sum(-1), o.sum(-1), r.sum(-1), s.sum(-1)),
    "importance_weighted_sum": lambda x, a, m, o, s, r: (x * losses.truncated_importance_weight(x, s, m)).sum(),
}


def torch_value_and_grad(case):
    x = torch.tensor(LOGP, dtype=torch.float32, requires_grad=True)
    args = [torch.tensor(v, dtype=torch.float32) for v in (ADV, MASK, OLD, SAMPLER, REF)]
    value = CASES[case](x, *args)
    value.backward()
    return float(value.detach()), x.grad.numpy()


def mlx_value_and_grad(case):
    args = [mx.array(v.astype(np.float32)) for v in (ADV, MASK, OLD, SAMPLER, REF)]
    value, grad = mx.value_and_grad(lambda x: CASES[case](x, *args))(mx.array(LOGP.astype(np.float32)))
    return float(value), np.array(grad)


@pytest.mark.parametrize("case", sorted(CASES))
def test_mlx_and_torch_agree_on_value_and_gradient(case):
    torch_value, torch_grad = torch_value_and_grad(case)
    mlx_value, mlx_grad = mlx_value_and_grad(case)
    assert mlx_value == pytest.approx(torch_value, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(mlx_grad, torch_grad, rtol=1e-4, atol=1e-6)
    assert np.abs(torch_grad).max() > 0  # a case whose gradient vanished would prove nothing


def test_sequence_logprobs_and_group_advantages_agree():
    mask = MASK.astype(bool)
    ours = losses.sequence_logprobs(mx.array(LOGITS.astype(np.float32)), mx.array(TARGETS), mx.array(mask))
    theirs = losses.sequence_logprobs(
        torch.tensor(LOGITS, dtype=torch.float32), torch.tensor(TARGETS), torch.tensor(mask)
    )
    np.testing.assert_allclose(np.array(ours), theirs.numpy(), rtol=1e-5, atol=1e-6)
    rewards = np.array([[0.1, 0.5, 0.9], [1.0, 1.0, 1.0]], dtype=np.float32)
    np.testing.assert_allclose(
        np.array(losses.group_advantages(mx.array(rewards))),
        losses.group_advantages(torch.tensor(rewards)).numpy(),
        rtol=1e-5,
        atol=1e-6,
    )
    assert np.all(np.array(losses.group_advantages(mx.array(rewards)))[1] == 0)
