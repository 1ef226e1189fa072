"""The learner's verification of rollout groups (train/verify.py) inside GRPOTrainer.step.

Real tiny model, real transformers engine, real training steps: honest groups come from the
engine at the version they claim, published to disk as the learner does; crafted groups are what
a hostile peer could send.
"""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path

import pytest
import torch
from helpers.verify_lab import TASK, Lab, write_peaked_model
from safetensors.torch import load_file

from echo2swarm.config.rl import TrainConfig, VerifyConfig
from echo2swarm.train.group import Group
from echo2swarm.train.grpo import completion_logits, token_logprobs
from echo2swarm.train.trainer import GRPOTrainer
from echo2swarm.train.verify import NonFiniteWeightsError, Verifier
from echo2swarm.train.scoring import _chunk_scores, score_logits, score_tokens, typicality_z


@pytest.fixture(autouse=True)
def _one_thread():
    """Lab trainers use one torch thread (tiny batches: more threads only wait on each other);
    the process setting is restored for the tests that run after these."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def state(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in trainer.model.state_dict().items()}


def all_finite(trainer: GRPOTrainer) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in trainer.model.state_dict().values())


def answer_group(lab: Lab, index: int, version: int, logprob: float, peer: str) -> Group:
    """The right answer G times, with a constant made-up logprob: a worker that runs no model."""
    eos = lab.trainer.tokenizer.eos_token_id
    answer = lab.trainer.encode_prompt(TASK.answer(index)) + [eos]
    g = lab.config.group_size
    return lab.group(TASK.prompt(index).prompt_id, version, [answer] * g, [[logprob] * len(answer)] * g,
                     ["stop"] * g, peer)


# ---------------------------------------------------------------------------------- hostile


def test_absurd_logprobs_are_refused_and_the_weights_stay_finite(tiny_model_dir: Path, tmp_path: Path) -> None:
    lab = Lab(tiny_model_dir, tmp_path)
    honest = lab.generate(range(6), 1, seed=1)
    one = lab.group(honest[0].prompt_id, 1, honest[0].completions,
                    [[-1e30 if (i, j) == (3, 0) else lp for j, lp in enumerate(lps)]
                     for i, lps in enumerate(honest[0].behaviour_logprobs)], honest[0].finish_reasons, "mallory")
    every = lab.group(honest[1].prompt_id, 1, honest[1].completions,
                      [[-1e30] * len(c) for c in honest[1].completions], honest[1].finish_reasons, "mallory",
                      rewards=[1.0] + [0.0] * 7)
    stats = lab.train(honest[2:] + [one, every])
    assert sorted(stats["refused_groups"]) == sorted([("mallory", one.prompt_id, "exact_mismatch"),
                                                      ("mallory", every.prompt_id, "exact_mismatch")])
    assert stats["verify_refused"] == {"exact_mismatch": 2}
    assert stats["groups_trained"] == 4 and stats["verify_checked"] == 6 and stats["skipped_nonfinite"] == 0
    assert stats["sequences"] == 4 * 8 and math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
    assert all_finite(lab.trainer)  # and v2 was signed-ready: publish() ran weights_bytes()

    # One version old, the absurd group is past its gap to the current policy, and the exact check
    # under its own version (which the learner still has) refuses it.
    older = lab.generate(range(10, 14), 1, seed=2)
    stale_bad = lab.group(older[0].prompt_id, 1, older[0].completions,
                          [[-1e30] * len(c) for c in older[0].completions], older[0].finish_reasons, "mallory")
    stats = lab.train(older[1:] + [stale_bad] + lab.generate(range(20, 22), 2, seed=3))
    assert stats["refused_groups"] == [("mallory", stale_bad.prompt_id, "exact_mismatch")]
    assert stats["stale_sequences"] == 3 * 8 and stats["skipped_nonfinite"] == 0
    assert all_finite(lab.trainer)


def test_constant_logprob_answers_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    lab = Lab(tiny_model_dir, tmp_path)
    honest = lab.generate(range(4), 1, seed=1)
    crafted = [answer_group(lab, 100 + i, 1, logprob, f"lazy{i}") for i, logprob in enumerate((-0.01, -0.5, -2.0))]
    stats = lab.train(honest + crafted)
    assert sorted(r[2] for r in stats["refused_groups"]) == ["exact_mismatch"] * 3
    assert {r[0] for r in stats["refused_groups"]} == {"lazy0", "lazy1", "lazy2"}
    assert stats["groups_trained"] == 4

    # A group one version old: the current policy is no exact reference any more; a peer refused
    # before has all its older groups checked exactly, under the version they claim.
    stale = answer_group(lab, 200, 1, -0.5, "lazy1")
    result = lab.check(lab.trainer.verifier, lab.generate(range(30, 33), 2, seed=2) + [stale])
    assert result.keep == [True, True, True, False]
    assert result.refusals[0].reason in ("exact_mismatch", "token_gap", "mean_gap")
    # The same from a peer with no history, with every older group sampled for the exact check.
    fresh = answer_group(lab, 201, 1, -0.5, "newcomer")
    result = lab.check(lab.verifier(sample_fraction=1.0), [fresh])
    assert result.keep == [False] and result.exact + result.refused["token_gap"] + result.refused["mean_gap"] >= 1


def test_exact_check_catches_logprobs_of_another_version(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A large learning rate, so one step moves the logprobs well past the tolerance; stale
    # bounds wide open, so only the exact check can tell.
    lab = Lab(tiny_model_dir, tmp_path, lr=1e-2)
    from_v1 = lab.generate(range(8), 1, seed=1)
    lab.train(lab.training_groups(range(100, 116), seed=2))
    from_v2 = lab.generate(range(8, 12), 2, seed=3)
    lab.train(lab.training_groups(range(200, 216), seed=4))
    mislabelled = [lab.group(g.prompt_id, 2, g.completions, g.behaviour_logprobs, g.finish_reasons, "liar")
                   for g in from_v1[4:]]
    verifier = lab.verifier(sample_fraction=1.0, token_gap_per_version=100.0, mean_gap_per_version=100.0,
                            typicality_z=None, spare_models=1)
    result = lab.check(verifier, from_v1[:4] + from_v2 + mislabelled)
    assert result.keep == [True] * 8 + [False] * 4
    assert {r.reason for r in result.refusals} == {"exact_mismatch"} and result.exact == 12
    assert not verifier._spares  # no copy kept: the older versions were streamed from their files

    # Version weights given as tensors rather than a directory work the same.
    by_tensors = Verifier(verifier.config, temperature=1.0, weights_of=lambda v: load_file(
        lab.dir(v) / "model.safetensors"), make_spare=lab.trainer._verify_spare)
    assert lab.check(by_tensors, from_v2 + mislabelled[:1]).keep == [True] * 4 + [False]
    # Honest groups whose version the policy has moved far from (bounds tight, no sampling): past the
    # proxy bounds, they get the exact check, which they pass; without their version's weights the
    # proxy refusal stands.
    tight = dict(sample_fraction=0.0, token_gap_per_version=0.0, mean_gap_per_version=0.0,
                 exact_tolerance=0.05, exact_mean_tolerance=0.01, typicality_z=None, spare_models=1)
    result = lab.check(lab.verifier(**tight), from_v1[:4])
    assert result.keep == [True] * 4 and result.exact == 4
    result = lab.check(Verifier(VerifyConfig(seed=0, **tight), temperature=1.0), from_v1[:4])
    assert result.keep == [False] * 4 and set(result.refused) <= {"token_gap", "mean_gap"}

    # Without any weights for older versions nothing is refused for want of a check.
    blind = Verifier(verifier.config, temperature=1.0)
    result = lab.check(blind, mislabelled)
    assert result.keep == [True] * 4 and result.unavailable == 4 and result.exact == 0


@pytest.fixture(scope="module")
def sharp_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its final norm scaled up: peaked next-token distributions, as a trained
    model has, so that text can be far less probable than sampling gives."""
    return write_peaked_model(tiny_model_dir, tmp_path_factory.mktemp("sharp") / "model", 25.0)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_typicality_refuses_text_the_policy_would_not_sample(sharp_model_dir: Path, tmp_path: Path,
                                                              temperature: float, top_p: float) -> None:
    lab = Lab(sharp_model_dir, tmp_path, temperature=temperature, top_p=top_p)
    honest = lab.generate(range(12), 1, seed=1)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    eos = lab.trainer.tokenizer.eos_token_id
    made_up = []
    for i in range(3):
        completions = [lab.trainer.encode_prompt("".join(rng.choice(letters) for _ in range(5))) + [eos]
                       for _ in range(8)]
        made_up.append(lab.true_logprobs(lab.group(TASK.prompt(300 + i).prompt_id, 1, completions,
                                                   [[0.0] * len(c) for c in completions], ["stop"] * 8, "writer"), 1))
    stats = lab.train(honest + made_up)
    assert stats["verify_refused"] == {"atypical_text": 3}
    assert {r[0] for r in stats["refused_groups"]} == {"writer"} and stats["groups_trained"] == 12


@pytest.mark.parametrize("engine_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_honest_groups_pass_fresh_and_stale(tiny_model_dir: Path, tmp_path: Path, engine_dtype: torch.dtype) -> None:
    lab = Lab(tiny_model_dir, tmp_path, engine_dtype=engine_dtype, verify=VerifyConfig())  # defaults, unseeded
    pools = {1: lab.generate(range(16), 1, seed=1)}
    for version in (1, 2):  # two real training steps on honest groups: v2, v3
        stats = lab.train(lab.training_groups(range(1000 * version, 1000 * version + 16), seed=10 + version))
        assert stats["refused_groups"] == [] and stats["groups_trained"] == 16
        pools[version + 1] = lab.generate(range(100 * version, 100 * version + 16), version + 1, seed=version)
    assert lab.version == 3
    mixed = pools[1] + pools[2] + pools[3]  # staleness 2, 1 and 0

    # Every group checked exactly under its own version: all pass.
    result = lab.check(lab.verifier(sample_fraction=1.0), mixed)
    assert result.refusals == [] and result.exact == 48 and result.unavailable == 0
    # And a real step at default settings trains on all of them.
    stats = lab.train(mixed)
    assert stats["refused_groups"] == [] and stats["verify_refused"] == {}
    assert stats["verify_checked"] == 48 and stats["verify_exact"] >= 16 and stats["groups_trained"] == 48
    assert stats["stale_sequences"] == 32 * 8 and stats["skipped_nonfinite"] == 0


def test_top_p_honest_groups_pass_and_full_softmax_claims_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The untrained model is nearly uniform: a top-p 0.8 nucleus holds ~0.8 of the mass, so a
    # logprob reported the old way (full softmax, not renormalised) is ~0.2 nats low on every token,
    # beyond the 0.1 mean tolerance of the exact check.
    lab = Lab(tiny_model_dir, tmp_path, temperature=0.9, top_p=0.8)
    from_v1 = lab.generate(range(8), 1, seed=1)
    stats = lab.train(lab.training_groups(range(100, 108), seed=2))  # a real step at top_p 0.8
    assert stats["refused_groups"] == [] and stats["groups_trained"] == 8
    from_v2 = lab.generate(range(8, 16), 2, seed=3)

    def old_way(group: Group, peer: str) -> Group:
        copy = lab.group(group.prompt_id, group.version, group.completions, group.behaviour_logprobs,
                         group.finish_reasons, peer)
        return lab.true_logprobs(copy, group.version, renormalised=False)

    # Honest groups, fresh (k = 0) and stale (exact-checked under their own version): all pass.
    # The same tokens with the true logprobs as the engines report them pass too (the helper
    # agrees with the engine); with the full-softmax ones, they are refused.
    blank = [[0.0] * len(c) for c in from_v1[0].completions]
    agreeing = lab.true_logprobs(lab.group(from_v1[0].prompt_id, 1, from_v1[0].completions, blank,
                                           from_v1[0].finish_reasons, "teacher"), 1)
    assert max(abs(a - b) for x, y in zip(agreeing.behaviour_logprobs, from_v1[0].behaviour_logprobs)
               for a, b in zip(x, y)) < 1e-4
    result = lab.check(lab.verifier(sample_fraction=1.0), from_v1 + from_v2 + [agreeing])
    assert result.refusals == [] and result.exact == 17
    old = [old_way(from_v2[0], "old-fresh"), old_way(from_v1[0], "old-stale")]
    result = lab.check(lab.verifier(sample_fraction=1.0), from_v1[1:] + from_v2[1:] + old)
    assert result.keep == [True] * 14 + [False, False]
    assert [(r.peer_id, r.reason) for r in result.refusals] == [("old-fresh", "exact_mismatch"),
                                                                ("old-stale", "exact_mismatch")]
    assert "mean |b - " in result.refusals[0].detail  # every token only ~0.2 nats off: the mean tells

    # And a real step at default settings trains on the honest ones, refusing the old-way ones.
    stats = lab.train(from_v1[1:] + from_v2[1:] + [old_way(from_v2[0], "old-fresh")])
    assert stats["refused_groups"] == [("old-fresh", from_v2[0].prompt_id, "exact_mismatch")]
    assert stats["groups_trained"] == 14 and stats["skipped_nonfinite"] == 0


# ---------------------------------------------------------------------------------- non-finite


def test_nonfinite_loss_skips_the_step_and_keeps_the_weights(tiny_model_dir: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    # What the learner did before verification, with one update per step: the absurd logprobs make the
    # PPO ratio infinite. (With several updates the decoupled objective caps their weight instead.)
    lab = Lab(tiny_model_dir, tmp_path, verify=VerifyConfig(enabled=False), minibatches=1)
    honest = lab.generate(range(3), 1, seed=1)
    absurd = lab.group(honest[0].prompt_id, 1, honest[0].completions,
                       [[-1e30] * len(c) for c in honest[0].completions], honest[0].finish_reasons, "mallory",
                       rewards=[1.0] + [0.0] * 7)
    before = state(lab.trainer)
    with caplog.at_level(logging.ERROR, logger="echo2swarm.train.updates"):
        stats = lab.trainer.step(honest[1:] + [absurd], current_version=1)
    assert stats["skipped_nonfinite"] == 1 and not math.isfinite(stats["loss"])
    assert lab.trainer.skipped_nonfinite == 1
    assert any(r.levelno == logging.ERROR and "SKIPPED" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(t, before[n]) for n, t in lab.trainer.model.state_dict().items())
    assert not lab.trainer.optimizer.state  # AdamW never stepped
    assert all(p.grad is None for p in lab.trainer.model.parameters())
    lab.trainer.weights_bytes()  # still finite, still publishable


def test_nonfinite_gradient_norm_skips_the_step(tiny_model_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    lab = Lab(tiny_model_dir, tmp_path, minibatches=1)
    groups = lab.generate(range(3), 1, seed=1)
    before = state(lab.trainer)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: torch.tensor(float("nan")))
    stats = lab.trainer.step(groups, current_version=1)
    assert stats["skipped_nonfinite"] == 1 and math.isfinite(stats["loss"]) and math.isnan(stats["grad_norm"])
    assert all(torch.equal(t, before[n]) for n, t in lab.trainer.model.state_dict().items())


def test_a_batch_with_every_group_refused_trains_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    lab = Lab(tiny_model_dir, tmp_path)
    crafted = [answer_group(lab, i, 1, -0.01, "lazy") for i in range(3)]
    before = state(lab.trainer)
    stats = lab.trainer.step(crafted, current_version=1)
    assert stats["groups_trained"] == 0 and stats["loss"] == 0.0 and stats["sequences"] == 0
    assert stats["verify_refused"] == {"exact_mismatch": 3} and len(stats["refused_groups"]) == 3
    assert stats["skipped_nonfinite"] == 0
    assert all(torch.equal(t, before[n]) for n, t in lab.trainer.model.state_dict().items())
    assert not lab.trainer.optimizer.state


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_weights_bytes_refuses_nonfinite_tensors(tiny_model_dir: Path, tmp_path: Path, bad: float) -> None:
    trainer = GRPOTrainer(tiny_model_dir, TrainConfig(device="cpu"))
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if "mlp" in n)
    with torch.no_grad():
        kept = param.view(-1)[0].item()
        param.view(-1)[0] = bad
    with pytest.raises(NonFiniteWeightsError, match=rf"non-finite .* {name}"):
        trainer.weights_bytes()
    with pytest.raises(NonFiniteWeightsError):
        trainer.save_model_dir(tmp_path / "final")
    assert not (tmp_path / "final").exists()
    with torch.no_grad():
        param.view(-1)[0] = kept
    assert trainer.weights_bytes()


# ---------------------------------------------------------------------------------- maths and API


def test_sampling_statistics_by_hand() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().view(1, 1, 4)
    log_mass, (surprisal, entropy, variance, outside) = _chunk_scores(logits, torch.tensor([[1]]), 1.0, True)
    h = float(-(probs * probs.log()).sum())
    assert log_mass is None  # no truncation: nothing to renormalise
    assert float(entropy) == pytest.approx(h, rel=1e-5)
    assert float(variance) == pytest.approx(float((probs * (-probs.log() - h) ** 2).sum()), rel=1e-5)
    assert float(surprisal) == pytest.approx(-math.log(0.3), rel=1e-5) and not bool(outside)
    # top_p 0.7: the nucleus is {0.5, 0.3} (mass above 0.15 is 0.8 >= 0.7), renormalised.
    log_mass, (surprisal, entropy, variance, outside) = _chunk_scores(logits, torch.tensor([[2]]), 0.7, True)
    pi = torch.tensor([0.5, 0.3]) / 0.8
    h = float(-(pi * pi.log()).sum())
    assert float(log_mass) == pytest.approx(math.log(0.8), rel=1e-5)
    assert float(entropy) == pytest.approx(h, rel=1e-5)
    assert float(variance) == pytest.approx(float((pi * (-pi.log() - h) ** 2).sum()), rel=1e-5)
    assert bool(outside) and float(surprisal) == pytest.approx(-math.log(0.15 / 0.8), rel=1e-5)
    # top_p 0.45: the mass ranked above 0.3 (0.5) is no longer short of it: {0.5} alone; 0.55: {0.5, 0.3}.
    log_mass, stats = _chunk_scores(logits, torch.tensor([[0]]), 0.45, False)
    assert stats is None and float(log_mass) == pytest.approx(math.log(0.5), rel=1e-5)
    log_mass, _ = _chunk_scores(logits, torch.tensor([[0]]), 0.55, False)
    assert float(log_mass) == pytest.approx(math.log(0.8), rel=1e-5)


@pytest.mark.parametrize("typicality", [True, False])
def test_sampling_logprobs_are_the_nucleus_renormalised_in_any_chunking(tiny_model_dir: Path, tmp_path: Path,
                                                                         typicality: bool) -> None:
    lab = Lab(tiny_model_dir, tmp_path, temperature=0.7, top_p=0.8)
    batch = lab.trainer.build_batch(lab.generate(range(4), 1, seed=3))
    with torch.no_grad():
        scored = completion_logits(lab.trainer.model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                   temperature=0.7)
    whole = score_logits(scored, top_p=0.8, typicality=typicality)
    by_row = score_logits(scored, top_p=0.8, typicality=typicality, chunk_elements=1)  # one row per chunk
    assert torch.equal(whole.sampling_logprobs, by_row.sampling_logprobs)
    # By hand, in float64: log(p[token] / mass of the tokens whose mass ranked above is < top_p).
    p = torch.softmax(scored.logits.double(), dim=-1)
    ranked = p.sort(dim=-1, descending=True).values
    mass = torch.where((ranked.cumsum(-1) - ranked) < 0.8, ranked, 0).sum(-1)
    expected = scored.spread((p.gather(-1, scored.targets.unsqueeze(-1)).squeeze(-1) / mass).log().float())
    assert torch.allclose(whole.sampling_logprobs, expected, atol=1e-5)
    keep = scored.keep
    lift = (whole.sampling_logprobs - whole.logprobs)[keep]
    assert bool((lift > 0).all()) and float(lift.max()) <= -math.log(0.8) + 1e-5  # mass is in [top_p, 1)
    assert torch.equal(whole.sampling_logprobs[~keep], torch.zeros_like(whole.logprobs[~keep]))
    # The identity at top_p = 1: the very tensor, so nothing changes numerically there.
    plain = score_logits(scored, top_p=1.0, typicality=typicality)
    assert plain.sampling_logprobs is plain.logprobs
    assert plain.rows(torch.tensor([0, 2])).sampling_logprobs is not None


def test_score_tokens_matches_token_logprobs_and_honest_z_is_small(tiny_model_dir: Path, tmp_path: Path) -> None:
    lab = Lab(tiny_model_dir, tmp_path)
    groups = lab.generate(range(8), 1, seed=5)
    batch = lab.trainer.build_batch(groups)
    scores = score_tokens(lab.trainer.model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                          temperature=1.0)
    with torch.no_grad():
        plain = token_logprobs(lab.trainer.model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert torch.equal(scores.logprobs, plain) and scores.sampling_logprobs is scores.logprobs
    per_row, together = typicality_z(scores, batch.completion_mask)
    assert per_row.shape == (64,) and float(per_row.max()) < 6 and abs(float(together)) < 4


def test_verify_config_is_a_learner_section() -> None:
    from echo2swarm.config.models import LearnerConfig

    field = LearnerConfig.model_fields["verify"]
    assert field.default_factory is VerifyConfig
    with pytest.raises(ValueError):
        VerifyConfig(sample_fraction=1.5)
    with pytest.raises(ValueError):
        VerifyConfig(unknown=1)
