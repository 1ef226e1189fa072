"""The trainer's updates compute the loss grpo.py defines, whatever the memory settings: micro-batching
changes no gradient, 'dapo' divides by the minibatches a step makes, the step's clip share leaves out
the update that cannot clip, and the policy's forwards have no dropout."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from echo2swarm.config.rl import TrainConfig, VerifyConfig
from echo2swarm.train.grpo import token_logprobs
from echo2swarm.train.group import Group
from echo2swarm.train.trainer import GRPOTrainer
from echo2swarm.train.updates import merge_updates
from helpers.groups import make_groups, with_own_logprobs

UNVERIFIED = VerifyConfig(enabled=False)


def _stale(trainer: GRPOTrainer, groups: list[Group], seed: int = 0) -> list[Group]:
    """The groups with behaviour logprobs 0.1 nats above to 0.5 below the trainer's own: importance
    weights exp(proximal - behaviour) from 0.9 to 1.65, on both sides of a cap of 1.2."""
    rng = random.Random(seed)
    return with_own_logprobs(trainer, groups, lambda v: v - rng.uniform(-0.1, 0.5))


def _first_update_gradient(model_dir: Path, groups: list[Group], **fields) -> torch.Tensor:
    """The gradient of the step's first optimizer update, as the optimizer receives it."""
    config = TrainConfig(device="cpu", ppo_epochs=2, minibatches=1, is_cap=1.2, grad_clip=1e9, **fields)
    trainer = GRPOTrainer(model_dir, config, verify=UNVERIFIED)
    if trainer.reference is not None:  # a reference away from the policy, so the KL has a gradient
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in trainer.reference.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    seen: list[torch.Tensor] = []

    def keep_gradient(optimizer, args, kwargs) -> None:
        if not seen:
            seen.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))

    trainer.optimizer.register_step_pre_hook(keep_gradient)
    stats = trainer.step(groups, current_version=2)  # version-1 groups: stale, decoupled
    assert stats["updates"] == 2 and stats["skipped_nonfinite"] == 0
    return seen[0]


KL = {"no KL": {}, "k3": {"kl_coef": 0.1, "kl_estimator": "k3"}, "k3_is": {"kl_coef": 0.1, "kl_estimator": "k3_is"}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loss_type", ["bnpo", "grpo", "dr_grpo", "dapo"])
def test_micro_batches_change_no_gradient(tiny_model_dir: Path, loss_type: str) -> None:
    base = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu"), verify=UNVERIFIED)
    groups = _stale(base, make_groups(base, n_groups=2, group_size=5))  # 10 rows: micro-batches of 4, 3, 3
    for is_mode in ("truncate", "mask"):
        for kl_name, kl in KL.items():
            fields = {"loss_type": loss_type, "is_mode": is_mode, **kl}
            whole = _first_update_gradient(tiny_model_dir, groups, **fields)
            split = _first_update_gradient(tiny_model_dir, groups, micro_batch_sequences=4, **fields)
            error = float((split - whole).norm() / whole.norm())
            assert error < 1e-6, (is_mode, kl_name, error)


@pytest.mark.timeout(120)
def test_dapo_divides_by_the_minibatches_the_step_makes(tiny_model_dir: Path) -> None:
    def step(groups: list[Group], **fields) -> dict:
        config = TrainConfig(device="cpu", ppo_epochs=1, **fields)
        return GRPOTrainer(tiny_model_dir, config, verify=UNVERIFIED).step(groups, current_version=1)

    base = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu"), verify=UNVERIFIED)
    groups = make_groups(base, n_groups=2)
    # One group, minibatches = 4: one minibatch holding every token of the step, so the token sum
    # over the step's tokens is the token mean.
    dapo, bnpo = step(groups[:1], loss_type="dapo", minibatches=4), step(groups[:1], loss_type="bnpo", minibatches=4)
    assert dapo["updates"] == 1
    assert dapo["loss"] == pytest.approx(bnpo["loss"], rel=1e-6)
    assert dapo["grad_norm"] == pytest.approx(bnpo["grad_norm"], rel=1e-6)
    # Two groups: minibatches = 4 makes the same two minibatches as minibatches = 2.
    four, two = step(groups, loss_type="dapo", minibatches=4), step(groups, loss_type="dapo", minibatches=2)
    assert four["updates"] == two["updates"] == 2
    assert four["loss"] == pytest.approx(two["loss"], rel=1e-6)
    assert four["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-6)


def test_the_step_clip_share_leaves_out_its_first_update() -> None:
    # The first update starts at the proximal policy (ratio 1): it never clips.
    updates = [{"loss": 1.0, "clip_frac": 0.0}, {"loss": 2.0, "clip_frac": 0.3}, {"loss": 3.0, "clip_frac": 0.1}]
    merged = merge_updates(updates)
    assert merged["clip_frac"] == pytest.approx(0.2)
    assert merged["loss"] == pytest.approx(2.0)
    assert merge_updates(updates[1:2])["clip_frac"] == pytest.approx(0.3)  # one update: its own share


@pytest.mark.timeout(120)
def test_the_policy_forwards_have_no_dropout(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The tiny model with attention dropout 0.5: scoring, proximal and objective forwards all give
    # the logprobs the model gives in eval mode (what rollout peers sample with).
    model_dir = tmp_path / "dropout"
    model_dir.mkdir()
    for path in tiny_model_dir.iterdir():
        (model_dir / path.name).write_bytes(path.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    config["attention_dropout"] = 0.5
    (model_dir / "config.json").write_text(json.dumps(config))

    trainer = GRPOTrainer(model_dir, TrainConfig(device="cpu"), verify=UNVERIFIED)
    assert trainer.model.training  # activation checkpointing acts in training mode only
    batch = trainer.build_batch(make_groups(trainer))
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = token_logprobs(reference, *args)
        proximal = token_logprobs(trainer.model, *args)
    objective = token_logprobs(trainer.model, *args)
    torch.testing.assert_close(proximal, expected)
    torch.testing.assert_close(objective.detach(), expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("verify", [UNVERIFIED, VerifyConfig()], ids=["unverified", "verified"])
def test_a_one_minibatch_step_reuses_the_proximal_forward_for_its_first_update(
    tiny_model_dir: Path, verify: VerifyConfig
) -> None:
    # ppo_epochs = 2, minibatches = 1: the proximal forward (with gradient) is the first update's
    # too, so the step makes two forwards, not three, and ends at the weights the step reaches with
    # a forward of its own per update (micro-batches switch the reuse off, as they do under torchrun).
    base = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu"), verify=UNVERIFIED)
    groups = with_own_logprobs(base, make_groups(base, n_groups=3, group_size=4))

    def step(**fields) -> tuple[int, dict, dict[str, torch.Tensor]]:
        config = TrainConfig(device="cpu", ppo_epochs=2, minibatches=1, lr=1e-3, **fields)
        trainer = GRPOTrainer(tiny_model_dir, config, verify=verify)
        forwards = []
        trainer.model.register_forward_hook(lambda *_: forwards.append(1))
        stats = trainer.step(groups, current_version=1)
        return len(forwards), stats, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    reused, reused_stats, reused_weights = step()
    own, own_stats, own_weights = step(micro_batch_sequences=1000)
    assert (reused, own) == (2, 3)
    assert reused_stats["updates"] == own_stats["updates"] == 2
    assert reused_stats["groups_trained"] == own_stats["groups_trained"] == 3
    assert reused_stats["loss"] == pytest.approx(own_stats["loss"], rel=1e-5, abs=1e-7)
    moved = max(float((reused_weights[k] - base.model.state_dict()[k]).abs().max()) for k in reused_weights)
    assert moved > 1e-4  # the step trained
    # Equal up to the order of float sums: AdamW normalises each gradient element, so one near zero can
    # move by a few percent of lr on rounding alone; nearly every element agrees to 1e-6.
    close = [torch.isclose(w, own_weights[k], rtol=1e-5, atol=1e-6) for k, w in reused_weights.items()]
    assert sum(int((~c).sum()) for c in close) <= 1e-3 * sum(c.numel() for c in close)
    for name, weight in reused_weights.items():
        torch.testing.assert_close(weight, own_weights[name], rtol=1e-5, atol=0.05 * 1e-3)
