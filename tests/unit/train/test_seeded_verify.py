"""The learner re-derives the choices of groups drawn with the lease's seeded sampler (train/verify.py,
protocol.md §10.4.1 check 6): honest groups pass from fp32 and bf16 engines with bf16 published
weights, at the step's own version and older ones; groups a peer sampled otherwise than the lease
says are refused as `sample_mismatch`, whatever logprobs they carry.

Real tiny models, real transformers engines, real training steps (helpers/verify_lab.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.verify_lab import Lab

from echo2swarm.config.rl import VerifyConfig
from echo2swarm.learner.evidence import PeerStatistics
from echo2swarm.models.tiny import write_tiny_model
from echo2swarm.rollout.engines.hf import TransformersEngine
from echo2swarm.train.group import Group
from echo2swarm.train.verify import NO_STRIKE, REASONS, Verifier


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("engine_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_honest_seeded_groups_pass_fresh_and_stale(peaked_model_dir: Path, tmp_path: Path, engine_dtype: torch.dtype,
                                                   temperature: float, top_p: float) -> None:
    lab = Lab(peaked_model_dir, tmp_path, engine_dtype=engine_dtype, temperature=temperature, top_p=top_p,
              publish_dtype=torch.bfloat16, verify=VerifyConfig())  # defaults: what a learner runs
    old = lab.generate(range(12), 1, seed=11, seeded=True)
    stats = lab.train(lab.generate(range(100, 112), 1, seed=12, seeded=True))  # a real step: v2, in bf16
    assert stats["refused_groups"] == [] and stats["verify_choices"] == 12
    fresh = lab.generate(range(200, 212), 2, seed=13, seeded=True)
    # Every group exact-checked: the stale ones under v1 as published, the fresh ones under the masters
    # (and, were any refused there, under v2 as published).
    result = lab.check(lab.verifier(sample_fraction=1.0), old + fresh)
    assert result.refusals == [] and result.choices == 24 and result.exact == 24
    # And a real step at default settings trains on all of them.
    stats = lab.train(old + fresh)
    assert stats["refused_groups"] == [] and stats["groups_trained"] == 24 and stats["verify_choices"] >= 12


def attack_lab(model_dir: Path, root: Path) -> Lab:
    return Lab(model_dir, root, publish_dtype=torch.bfloat16, verify=VerifyConfig(seed=0))


def refused_as(lab: Lab, groups: list[Group]) -> list[str]:
    result = lab.check(lab.verifier(), groups)
    return [r.reason for r in result.refusals]


def crossed_after(lab: Lab, groups: list[Group]) -> tuple[list[str], int | None]:
    """The refusals of one check of ``groups`` (one peer's), and after how many of them its choice
    test crossed (None: it did not)."""
    result = lab.check(lab.verifier(), groups)
    statistics = PeerStatistics(lab.trainer.verify_config, max_peers=4)
    crossed = next((n + 1 for n, e in enumerate(result.evidence) if statistics.observe(e) is not None), None)
    return [r.reason for r in result.refusals], crossed


def test_groups_sampled_otherwise_than_the_lease_says_are_refused(peaked_model_dir: Path, tmp_path: Path) -> None:
    lab = attack_lab(peaked_model_dir, tmp_path)  # the lease: T = 1, top_p = 1, seed 21
    prompts = range(300, 306)
    honest = lab.generate(prompts, 1, seed=21, seeded=True)
    assert refused_as(lab, honest) == []
    assert crossed_after(lab, honest)[1] is None
    attacks = {
        "T 1.2": lab.generate(prompts, 1, seed=21, seeded=True, temperature=1.2),
        "T 0.8": lab.generate(prompts, 1, seed=21, seeded=True, temperature=0.8),
        "top_p 0.9": lab.generate(prompts, 1, seed=21, seeded=True, top_p=0.9),
        "greedy": lab.generate(prompts, 1, seed=21, seeded=True, temperature=0.0),
        "another lease's noise": lab.generate(prompts, 1, seed=22, seeded=True),
    }
    for name, groups in attacks.items():
        for g in groups:  # the policy's true logprobs, as the engine would have reported them: only the choices lie
            lab.true_logprobs(g, 1)
            g.seed = 21
        reasons, crossed = crossed_after(lab, groups)
        assert set(reasons) <= {"sample_mismatch"}, (name, reasons)
        if name.startswith("T "):
            # Within δ of the lease's choices at most positions, so few groups are proof alone; the
            # peer's choice test, fed every group, crosses within these six.
            assert crossed is not None, name
        else:
            assert len(reasons) >= 4, (name, reasons)  # of 6 groups of 8 completions


def test_another_model_with_the_policys_true_logprobs_is_refused(peaked_model_dir: Path, tmp_path: Path) -> None:
    lab = attack_lab(peaked_model_dir, tmp_path)
    other = TransformersEngine(write_tiny_model(tmp_path / "other", seed=1), threads=1)  # same architecture
    groups = lab.generate(range(400, 406), 1, seed=31, seeded=True, engine=other)
    for g in groups:
        lab.true_logprobs(g, 1)  # every logprob check passes: they are exact
    stats = lab.train(groups + lab.generate(range(410, 414), 1, seed=32, seeded=True))
    assert {r[2] for r in stats["refused_groups"]} == {"sample_mismatch"} and stats["groups_trained"] == 4
    assert len(stats["refused_groups"]) == 6


def test_version_t_is_judged_under_its_published_weights_not_the_masters(peaked_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    # The engine runs v2 as published in bf16; the step's own forward runs the fp32 masters, which differ
    # from it by the cast's rounding. With no slack at all, that rounding alone refuses honest groups
    # under the masters; the check under v2 as published, which decides, passes them.
    lab = attack_lab(peaked_model_dir, tmp_path)
    lab.train(lab.generate(range(100, 112), 1, seed=1, seeded=True))
    fresh = lab.generate(range(500, 516), 2, seed=41, seeded=True)
    strict = dict(sample_tolerance=0.0, exact_tolerance=1e-4, exact_mean_tolerance=1e-5)
    result = lab.check(lab.verifier(**strict), fresh)
    assert result.refusals == [] and result.choices == 16
    # A learner without v2's weights keeps the masters' verdict.
    result = lab.check(Verifier(VerifyConfig(seed=0, **strict), temperature=1.0), fresh)
    assert result.refusals and result.unavailable == len(result.refusals)


def test_unseeded_groups_get_every_other_check_and_no_choice_check(peaked_model_dir: Path, tmp_path: Path) -> None:
    lab = attack_lab(peaked_model_dir, tmp_path)
    result = lab.check(lab.verifier(), lab.generate(range(600, 604), 1, seed=51))
    assert result.refusals == [] and result.choices == 0 and result.exact == 4


def test_a_sample_mismatch_is_proof_and_only_atypical_text_is_no_strike() -> None:
    assert "sample_mismatch" in REASONS and NO_STRIKE == {"atypical_text"}


def test_evidence_for_the_peer_tests_comes_only_from_a_groups_own_version(peaked_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    lab = attack_lab(peaked_model_dir, tmp_path)  # the lease: T = 1, top_p = 1
    verifier = lab.verifier(sample_fraction=0.0, newcomer_groups=4)
    honest = lab.generate(range(700, 704), 1, seed=61, seeded=True)
    result = lab.check(verifier, honest)  # k = 0: the step's own forward is version 1
    assert result.refusals == [] and [e.peer_id for e in result.evidence] == ["honest"] * 4
    assert all(e.choice == 0.0 and e.positions == sum(map(len, g.completions)) and e.z is not None
               for e, g in zip(result.evidence, honest))
    hot = lab.generate(range(710, 714), 1, seed=62, seeded=True, temperature=1.3, peer="hot")
    for g in hot:
        lab.true_logprobs(g, 1)
    result = lab.check(verifier, hot)
    assert sum(e.choice for e in result.evidence) > 4 * 28 * lab.trainer.verify_config.peer_choice_allowance

    lab.train(lab.generate(range(100, 112), 1, seed=63, seeded=True))  # v2: the groups below are one version old
    # "honest" delivered its newcomer_groups: an older group of it is not re-derived (no sample), and the
    # proxy's z is no evidence. A newcomer's is, and so is one from "hot", a suspect since its choices strayed.
    old = lab.generate(range(720, 723), 1, seed=64, seeded=True)
    old[1].peer_id, old[2].peer_id = "newcomer", "hot"
    result = lab.check(verifier, old)
    assert result.refusals == []  # all three are honest groups: only who sent them differs
    assert {e.peer_id for e in result.evidence} == {"newcomer", "hot"} and result.exact == 2
    assert all(e.choice is not None and e.z is not None for e in result.evidence)
