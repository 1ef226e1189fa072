"""vLLM and the transformers engine draw the same seeded completions, and the learner accepts vLLM's.

Both engines hold the same float32 version of a policy whose next-token distributions are as peaked
as a trained model's (so that a wrong draw shows); given the same lease (seed, prompt ids, T, top_p)
they must choose the same tokens and report logprobs within the engines' numeric tolerance. The
learner's verification (train/verify.py, every group exact-checked) re-derives every choice of
vLLM's groups and refuses none, and a real training step trains on all of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.engine_contract import assert_same_completions
from helpers.verify_lab import Lab, write_peaked_model

from echo2swarm.config.rl import VerifyConfig
from echo2swarm.models.tiny import write_tiny_model
from echo2swarm.rollout.engines import Completion, Engine, make_engine
from echo2swarm.train.group import Group

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its final norm scaled up 6x (as tests/unit/train/test_seeded_verify.py)."""
    plain = write_tiny_model(tmp_path_factory.mktemp("plain") / "model", seed=0)
    return write_peaked_model(plain, tmp_path_factory.mktemp("peaked") / "model", 6.0)


@pytest.fixture(scope="module")
def vllm_engine(peaked_model_dir: Path) -> Iterator[Engine]:
    built = make_engine("vllm", peaked_model_dir, vllm_options={"kv_cache_gib": 0.25})
    yield built
    built.close()


def completions(groups: list[Group]) -> list[list[Completion]]:
    return [[Completion(c, lp, f) for c, lp, f in zip(g.completions, g.behaviour_logprobs, g.finish_reasons)]  # type: ignore[arg-type]
            for g in groups]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_vllm_draws_the_transformers_engines_tokens_and_the_learner_accepts_them(
    peaked_model_dir: Path, vllm_engine: Engine, tmp_path: Path, temperature: float, top_p: float
) -> None:
    # Version 1 published in float32: the weights both engines hold. Learner defaults otherwise.
    lab = Lab(peaked_model_dir, tmp_path, temperature=temperature, top_p=top_p, verify=VerifyConfig())
    prompts, seed = range(16), 2**61 + 12345
    reference = lab.generate(prompts, 1, seed=seed, seeded=True)
    groups = lab.generate(prompts, 1, seed=seed, seeded=True, engine=vllm_engine)  # type: ignore[arg-type]

    # The same tokens, choice for choice; logprobs as close as the engines' float32 logits are.
    assert_same_completions(completions(groups), completions(reference), 1e-4)
    tokens = sum(len(c) for g in groups for c in g.completions)
    print(f"\nT={temperature} top_p={top_p}: vLLM and transformers drew the same {tokens} tokens in "
          f"{len(groups)} groups of {len(groups[0].completions)}")
    # The learner re-derives every choice of vLLM's groups from its own forward and refuses none...
    result = lab.check(lab.verifier(sample_fraction=1.0), groups)
    assert result.refusals == [] and result.choices == len(groups)
    # ...and a real step at default settings trains on all of them.
    stats = lab.train(groups)
    assert stats["refused_groups"] == [] and stats["groups_trained"] == len(groups)
