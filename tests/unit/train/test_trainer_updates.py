"""Several optimizer updates per step: the PPO clip acts, proximal logprobs stay fixed over the step,
and the off-policy gap is measured and (optionally) acted on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from echo2swarm.config.rl import TrainConfig, VerifyConfig
from echo2swarm.train.grpo import LossOptions, grpo_loss, token_logprobs
from echo2swarm.train.trainer import GRPOTrainer
from helpers.groups import make_groups, with_own_logprobs

UNVERIFIED = VerifyConfig(enabled=False)


@pytest.mark.timeout(120)
def test_one_update_never_clips_and_several_do(tiny_model_dir: Path) -> None:
    single = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu", lr=5e-2, minibatches=1, ppo_epochs=1), verify=UNVERIFIED)
    groups = with_own_logprobs(single, make_groups(single, n_groups=4))
    stats = single.step(groups, current_version=1)
    assert stats["updates"] == 1
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)

    several = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu", lr=5e-2, minibatches=2, ppo_epochs=2),
                          verify=UNVERIFIED)
    stats = several.step(groups, current_version=1)
    assert stats["updates"] == 4
    assert stats["clip_frac"] > 0.0  # later minibatches see the policy moved by the earlier updates
    assert stats["skipped_nonfinite"] == 0


@pytest.mark.timeout(120)
def test_minibatch_updates_clip_against_the_step_start_policy(tiny_model_dir: Path) -> None:
    """Two minibatches, one epoch: the second update's ratio is taken against the policy before the
    first update (the proximal policy), which we recompute by hand from a copy of the model."""
    config = TrainConfig(device="cpu", lr=1e-2, minibatches=2, ppo_epochs=1, seed=3)
    trainer = GRPOTrainer(tiny_model_dir, config, verify=UNVERIFIED)
    groups = with_own_logprobs(trainer, make_groups(trainer, n_groups=2))
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    batch = trainer.build_batch(groups)
    with torch.no_grad():
        proximal = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.completion_mask)

    stats = trainer.step(groups, current_version=1)
    assert stats["updates"] == 2
    # After the step the policy moved away from the proximal one; the moved ratio is what the clip bounds.
    with torch.no_grad():
        after = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    mask = batch.completion_mask.bool()
    assert float((after - proximal)[mask].abs().max()) > 0
    assert any(not torch.equal(v, start[k]) for k, v in trainer.model.state_dict().items())


@pytest.mark.timeout(120)
def test_offpolicy_gap_measured_and_groups_beyond_the_limit_dropped(tiny_model_dir: Path) -> None:
    base = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu", minibatches=1, ppo_epochs=1), verify=UNVERIFIED)
    groups = make_groups(base, n_groups=3)
    near = with_own_logprobs(base, groups[:2], lambda v: v - 0.05)  # behaviour 0.05 nats below proximal
    far = with_own_logprobs(base, groups[2:], lambda v: v - 1.5)
    stats = base.step(near + far, current_version=2)  # version 1 data at step 2: stale, decoupled
    assert stats["offpolicy_gap_max"] == pytest.approx(1.5, abs=1e-4)
    assert 0.05 < stats["offpolicy_gap_mean"] < 1.5
    assert stats["offpolicy_dropped"] == 0 and stats["groups_trained"] == 3

    limited = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu", minibatches=1, ppo_epochs=1, max_offpolicy_gap=0.5),
                          verify=UNVERIFIED)
    stats = limited.step(near + far, current_version=2)
    assert stats["offpolicy_dropped"] == 1 and stats["groups_trained"] == 2
    assert stats["offpolicy_gap_max"] == pytest.approx(0.05, abs=1e-4)  # the far group left the objective


@pytest.mark.timeout(120)
def test_single_update_matches_grpo_loss_with_the_configured_options(tiny_model_dir: Path) -> None:
    config = TrainConfig(device="cpu", minibatches=1, ppo_epochs=1, loss_type="dr_grpo", is_mode="mask", is_level="sequence")
    trainer = GRPOTrainer(tiny_model_dir, config, verify=UNVERIFIED)
    groups = make_groups(trainer, n_groups=2)
    batch = trainer.build_batch(groups)
    with torch.no_grad():
        lp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    options = LossOptions(loss_type="dr_grpo", is_mode="mask", is_level="sequence",
                          max_completion_length=config.max_new_tokens)
    expected, _ = grpo_loss(lp, batch.behaviour, batch.advantages, batch.completion_mask, proximal_logprobs=lp,
                            options=options)
    stats = trainer.step(groups, current_version=2)
    assert stats["loss"] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.timeout(60)
def test_adam_betas_reach_the_optimizer_and_are_validated(tiny_model_dir: Path) -> None:
    trainer = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu", adam_beta1=0.5, adam_beta2=0.99), verify=UNVERIFIED)
    assert trainer.optimizer.param_groups[0]["betas"] == (0.5, 0.99)
    for bad in ({"adam_beta1": 1.0}, {"adam_beta1": -0.1}, {"adam_beta2": 0.0}, {"adam_beta2": 1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TrainConfig(**bad)
