"""`is_mode = "mask"` by hand: a masked token's weight is zero (never inf times zero), and masked
tokens stay in the normaliser, as in AReaL and TRL (docs/architecture.md §7)."""

from __future__ import annotations

import math

import pytest
import torch

from echo2swarm.train.grpo import LossOptions, grpo_loss


def _masked_loss(gaps: list[list[float]], advantages: list[float], dtype: torch.dtype = torch.float64,
                 **options) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """On-policy within the step (ratio 1): logprobs = proximal, proximal - behaviour = ``gaps``."""
    proximal = torch.full((len(gaps), len(gaps[0])), -1.0, dtype=dtype)
    behaviour = proximal - torch.tensor(gaps, dtype=dtype)
    lp = proximal.clone().requires_grad_(True)
    loss, stats = grpo_loss(lp, behaviour, torch.tensor(advantages, dtype=dtype), torch.ones_like(proximal),
                            proximal_logprobs=proximal, options=LossOptions(is_mode="mask", is_cap=2.0, **options))
    loss.backward()
    return loss, lp.grad, stats


def test_a_weight_that_overflows_masks_its_sequence_without_nan() -> None:
    # Row 0's summed log-gap is 90 nats: its sequence weight exp(90) is inf in float32. Row 1's is
    # exp(0.2) = 1.2214 < the cap. Masked, row 0 contributes zero; its tokens stay in the token mean:
    # loss = -A1 w1 * 3 / 6 tokens, d/dlp = -A1 w1 / 6 on row 1's tokens, 0 on row 0's.
    w1 = math.exp(0.2)
    loss, grad, stats = _masked_loss([[30.0, 30.0, 30.0], [0.1, 0.2, -0.1]], [1.0, -1.0], dtype=torch.float32,
                                     is_level="sequence_product")
    assert torch.isfinite(grad).all() and math.isfinite(stats["is_ess"])
    assert loss.item() == pytest.approx(3 * w1 / 6, rel=1e-6)
    expected = torch.tensor([[0.0] * 3, [w1 / 6] * 3])
    torch.testing.assert_close(grad, expected)
    # effective sample size of (inf, inf, inf, w1, w1, w1): (3w)^2 / (6 * 3w^2) = 0.5 in the limit
    assert stats["is_ess"] == pytest.approx(0.5, rel=1e-4)  # float32
    assert stats["is_masked_frac"] == pytest.approx(0.5)
    assert stats["is_weight_mean"] == pytest.approx(w1, rel=1e-6)


@pytest.mark.parametrize("options", [
    {"loss_type": "bnpo"},
    {"loss_type": "grpo"},
    {"loss_type": "dr_grpo", "max_completion_length": 4},
    {"loss_type": "dapo", "global_tokens": 4.0},
])
def test_masked_tokens_stay_in_the_normaliser(options: dict) -> None:
    # 4 tokens with advantage 1, one with weight 3 > the cap of 2: -(1 + 1 + 1 + 0) / 4.
    loss, grad, _ = _masked_loss([[0.0, math.log(3.0), 0.0, 0.0]], [1.0], **options)
    assert loss.item() == pytest.approx(-0.75)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, 0.0, -0.25, -0.25]], dtype=torch.float64))


def test_a_masked_sequence_counts_in_the_mean_of_sequences() -> None:
    # 'grpo': row 0 (weight 3) leaves the objective, its mean of 0 still counts: (0 + -1) / 2.
    loss, grad, _ = _masked_loss([[math.log(3.0)] * 2, [0.0, 0.0]], [1.0, 1.0], loss_type="grpo",
                                 is_level="sequence")
    assert loss.item() == pytest.approx(-0.5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]], dtype=torch.float64))
