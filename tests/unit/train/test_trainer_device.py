"""GRPOTrainer (and the transformers engine) on `device`: CPU numerics unchanged, CUDA when there is one.

The tests marked `gpu` run only where torch sees a CUDA device; CI on CPUs skips them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM

from echo2swarm.config.rl import TrainConfig, VerifyConfig
from echo2swarm.train.grpo import LossOptions, grpo_loss, token_logprobs
from echo2swarm.train.trainer import GRPOTrainer
from helpers.groups import make_groups

no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
# make_groups' completions are random tokens with made-up behaviour logprobs: the learner's
# verification (tests/unit/train/test_verify.py) rightly refuses them, so these tests, about
# devices and numerics, train with it off.
UNVERIFIED = VerifyConfig(enabled=False)


def test_cpu_step_matches_the_plain_cpu_recipe(tiny_model_dir: Path) -> None:
    """device="cpu" with one update per step trains exactly as the plain recipe: same loss, same weights."""
    config = TrainConfig(device="cpu", lr=1e-3, minibatches=1, ppo_epochs=1)
    trainer = GRPOTrainer(tiny_model_dir, config, verify=UNVERIFIED)
    assert trainer.device == torch.device("cpu")
    groups = make_groups(trainer)
    batch = trainer.build_batch(groups)
    assert all(t.device.type == "cpu" for t in vars(batch).values())

    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(config.adam_beta1, config.adam_beta2))
    logprobs = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    loss, _ = grpo_loss(logprobs, batch.behaviour, batch.advantages, batch.completion_mask,
                        options=LossOptions.from_config(config))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()

    stats = trainer.step(groups, current_version=1)
    assert stats["loss"] == float(loss.detach())
    expected = model.state_dict()
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_weights_round_trip_as_fp32_cpu_safetensors(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu"), verify=UNVERIFIED)
    trainer.step(make_groups(trainer), current_version=1)
    tensors = load_safetensors(trainer.weights_bytes())
    assert tensors and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors.values())
    other = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu"))
    other.load_weights(tensors)
    for name, tensor in other.model.state_dict().items():
        assert torch.equal(tensor, trainer.model.state_dict()[name]), name
    out = trainer.save_model_dir(tmp_path / "final")
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.float32


def test_cuda_without_cuda_fails_at_construction(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    from echo2swarm.rollout.engines.hf import TransformersEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"train.device \(--device\) is 'cuda' but no CUDA device is visible"):
        GRPOTrainer(tiny_model_dir, TrainConfig(device="cuda"))
    with pytest.raises(ValueError, match=r"engine.device \(--device\) is 'cuda:0' but no CUDA device is visible"):
        TransformersEngine(tiny_model_dir, device="cuda:0")
    assert GRPOTrainer(tiny_model_dir, TrainConfig(device="auto")).device == torch.device("cpu")


@pytest.mark.gpu
@no_cuda
def test_trainer_on_cuda_keeps_everything_on_the_gpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    from echo2swarm.learner.checkpoint import load_latest, save_checkpoint

    config = TrainConfig(device="cuda", kl_coef=0.05, lr=1e-3)
    gpu = GRPOTrainer(tiny_model_dir, config, verify=UNVERIFIED)
    cpu = GRPOTrainer(tiny_model_dir, config.model_copy(update={"device": "cpu"}), verify=UNVERIFIED)
    assert all(p.device.type == "cuda" for p in gpu.model.parameters())
    assert gpu.reference is not None and all(p.device.type == "cuda" for p in gpu.reference.parameters())
    groups = make_groups(gpu, version=1)
    assert all(t.device.type == "cuda" for t in vars(gpu.build_batch(groups)).values())

    for step in (1, 2):  # the second step trains on stale groups (decoupled PPO)
        stats_gpu, stats_cpu = gpu.step(groups, current_version=step), cpu.step(groups, current_version=step)
        assert stats_gpu["stale_sequences"] == stats_cpu["stale_sequences"] == (12 if step == 2 else 0)
        assert stats_gpu["loss"] == pytest.approx(stats_cpu["loss"], rel=1e-4, abs=1e-6)
    state = gpu.optimizer.state_dict()["state"]
    assert state and all(s["exp_avg"].device.type == "cuda" for s in state.values())

    tensors = load_safetensors(gpu.weights_bytes())
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors.values())
    # Adam moves every weight by about lr whatever its gradient's size, so an element whose tiny
    # gradient differs between the GPU and the CPU kernels may move differently; almost none may.
    cpu_state = cpu.model.state_dict()
    diffs = torch.cat([(tensor - cpu_state[name]).abs().flatten() for name, tensor in tensors.items()])
    assert float(diffs.max()) <= 2 * 2 * config.lr
    assert float((diffs > 1e-5).float().mean()) < 1e-3
    out = gpu.save_model_dir(tmp_path / "final")
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.float32

    # A GPU learner's checkpoint resumes on the GPU and on a CPU-only learner.
    save_checkpoint(tmp_path / "run", step=2, version=3, trainer=gpu, extra={}, keep=1)
    checkpoint = load_latest(tmp_path / "run")
    assert checkpoint is not None
    for device in ("cpu", "cuda"):
        resumed = GRPOTrainer(tiny_model_dir, config.model_copy(update={"device": device}), verify=UNVERIFIED)
        checkpoint.restore(resumed)
        moments = resumed.optimizer.state_dict()["state"].values()
        assert all(s["exp_avg"].device.type == device for s in moments)
        assert resumed.step(groups, current_version=3)["stale_sequences"] == 12


@pytest.mark.gpu
@no_cuda
def test_transformers_engine_on_cuda(tiny_model_dir: Path) -> None:
    from echo2swarm.rollout.engines import SamplingParams, make_engine

    engine = make_engine("transformers", tiny_model_dir, threads=1, device="cuda")
    assert engine.device.type == "cuda" and next(engine.model.parameters()).device.type == "cuda"
    groups = engine.generate(["12+3=", "7+8="], SamplingParams(n=4, max_new_tokens=6, seed=1))
    assert [len(g) for g in groups] == [4, 4]
    for completion in (c for g in groups for c in g):
        assert len(completion.token_ids) == len(completion.logprobs) >= 1
        assert all(lp <= 0 for lp in completion.logprobs)
