"""The KL term of grpo_loss against exact enumeration: a tabular policy over a 3-token vocabulary,
every completion of T tokens in the batch, each as many times as the behaviour policy mu draws it
(mu's probabilities are multiples of 1/16), so the batch mean *is* the expectation under mu.

KL(pi || ref) of a completion is the sum over its positions; the token-mean loss over rows of T
tokens is that divided by T. Value and gradient must both be exact where the docs say so
(docs/architecture.md §7)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from echo2swarm.train.grpo import LossOptions, grpo_loss

D = torch.float64
V = 3
# mu's next-token distributions, in 16ths: rotated per prefix so mu differs from prefix to prefix.
MU_ROWS = [(8, 4, 4), (4, 8, 4), (1, 7, 8), (4, 4, 8), (2, 12, 2), (8, 7, 1)]


def _prefixes(length: int) -> list[tuple[int, ...]]:
    return [p for t in range(length) for p in itertools.product(range(V), repeat=t)]


def _mu_table(length: int) -> torch.Tensor:
    """[prefixes, V] behaviour probabilities, multiples of 1/16."""
    return torch.tensor([MU_ROWS[i % len(MU_ROWS)] for i in range(len(_prefixes(length)))], dtype=D) / 16


class Tabular:
    """pi(y_t | y_<t) = softmax(theta[prefix]); mu and ref tables alike, fixed."""

    def __init__(self, length: int, *, on_policy: bool, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.length = length
        index = {p: i for i, p in enumerate(_prefixes(length))}
        self.mu = _mu_table(length)
        theta = self.mu.log() if on_policy else torch.randn(len(index), V, generator=gen, dtype=D)
        self.theta = theta.clone().requires_grad_(True)
        self.ref = torch.softmax(torch.randn(len(index), V, generator=gen, dtype=D), dim=-1)
        completions = list(itertools.product(range(V), repeat=length))  # every completion once
        self.prefix = torch.tensor([[index[y[:t]] for t in range(length)] for y in completions])
        self.token = torch.tensor(completions)

    def _pick(self, table: torch.Tensor) -> torch.Tensor:
        """[completions, T]: each token's entry of ``table`` given its prefix."""
        return table[self.prefix, self.token]

    def batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, T] logprobs (with grad), behaviour and ref logprobs: completion y repeated 16^T mu(y) times."""
        copies = (self._pick(self.mu).prod(dim=1) * 16 ** self.length).round().long()
        lp = self._pick(torch.log_softmax(self.theta, dim=-1))
        return tuple(t.repeat_interleave(copies, dim=0) for t in (lp, self._pick(self.mu).log(),
                                                                 self._pick(self.ref).log()))

    def exact_kl(self) -> torch.Tensor:
        """KL(pi || ref) of a whole completion, summed exactly over every completion."""
        logpi = self._pick(torch.log_softmax(self.theta, dim=-1))
        return (logpi.sum(dim=1).exp() * (logpi - self._pick(self.ref).log()).sum(dim=1)).sum()


def _kl_loss(policy: Tabular, *, cap: float | None, estimator: str = "k3_is") -> tuple[torch.Tensor, dict]:
    lp, behaviour, ref = policy.batch()
    advantages = torch.zeros(lp.shape[0], dtype=D)  # the policy term is zero: only the KL term remains
    return grpo_loss(lp, behaviour, advantages, torch.ones_like(lp), ref_logprobs=ref,
                     options=LossOptions(kl_estimator=estimator, kl_coef=1.0, is_cap=cap))


@pytest.mark.parametrize(("length", "on_policy", "cap"), [
    (1, False, None),   # one token, off-policy: the case the old test covered
    (2, True, None),    # on-policy, several tokens: the later tokens' KL depends on the earlier ones
    (3, True, 10.0),
    (2, False, None),   # off-policy: mu's prefixes are not pi's
    (3, False, None),
    (2, False, 10.0),   # a cap that no prefix weight of this policy reaches changes nothing
])
def test_k3_is_is_exact_in_value_and_gradient(length: int, on_policy: bool, cap: float | None) -> None:
    policy = Tabular(length, on_policy=on_policy, seed=length)
    loss, stats = _kl_loss(policy, cap=cap)
    lp, behaviour, _ = policy.batch()
    if cap is not None:  # the case is what its comment says
        assert float((lp.detach() - behaviour).cumsum(dim=1).exp().max()) < cap
    loss.backward()
    grad = policy.theta.grad.clone()

    policy.theta.grad = None
    exact = policy.exact_kl() / length
    exact.backward()
    assert stats["kl"] == pytest.approx(exact.item(), rel=1e-9)
    assert loss.item() == pytest.approx(exact.item(), rel=1e-9)
    torch.testing.assert_close(grad, policy.theta.grad, rtol=1e-9, atol=1e-12)


def test_k3_is_weights_are_truncated_at_the_cap() -> None:
    # Off-policy with prefix weights pi(y<=t)/mu(y<=t) above 10: each is cut to 10, so the estimate
    # is sum_t E_mu[min(w_t, cap) k3_t] / T, and (k3 >= 0) no more than the exact KL.
    policy = Tabular(2, on_policy=False, seed=7)
    with torch.no_grad():
        policy.theta[0] = torch.tensor([-2.0, 3.0, -2.0], dtype=D)  # token 1 first (mu: 4 in 16), then
        policy.theta[2] = torch.tensor([4.0, -1.0, -1.0], dtype=D)  # token 0 (mu: 1 in 16 after token 1)
    cap = 10.0
    lp, behaviour, ref = policy.batch()
    weights = (lp.detach() - behaviour).cumsum(dim=1).exp()
    assert float(weights.max()) > cap
    delta = ref - lp.detach()
    k3 = delta.exp() - delta - 1
    expected = float((weights.clamp(max=cap) * k3).mean())
    _, stats = _kl_loss(policy, cap=cap)
    assert stats["kl"] == pytest.approx(expected, rel=1e-9)
    assert stats["kl"] < policy.exact_kl().item() / 2
    _, uncapped = _kl_loss(policy, cap=None)
    assert uncapped["kl"] == pytest.approx(policy.exact_kl().item() / 2, rel=1e-9)


def test_plain_k3_is_biased_off_policy_and_its_gradient_is_not_the_reverse_kl() -> None:
    # 'k3' (no weights) is what TRL computes: on-policy its value is exact, its gradient is not.
    policy = Tabular(2, on_policy=True, seed=2)
    loss, stats = _kl_loss(policy, cap=None, estimator="k3")
    loss.backward()
    grad = policy.theta.grad.clone()
    policy.theta.grad = None
    exact = policy.exact_kl() / 2
    exact.backward()
    assert stats["kl"] == pytest.approx(exact.item(), rel=1e-9)
    assert float((grad - policy.theta.grad).norm()) > 1e-2 * float(policy.theta.grad.norm())
    off = Tabular(2, on_policy=False, seed=2)
    _, stats = _kl_loss(off, cap=None, estimator="k3")
    assert not math.isclose(stats["kl"], off.exact_kl().item() / 2, rel_tol=1e-3)
