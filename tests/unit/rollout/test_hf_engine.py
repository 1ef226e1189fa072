"""Tests for the transformers rollout engine on the tiny model.

The engine contract both engines share lives in helpers/engine_contract.py and runs here as
TestTransformersEngineContract; the rest is what only this engine does (KV-cache compaction,
sub-batches, top-p) and the engine-agnostic SamplingParams and make_engine. Every logprob is
checked against teacher forcing on a second transformers engine with the same weights.
"""

from __future__ import annotations

import dataclasses

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.engine_contract import (
    MIXED_PROMPTS,
    PROMPT_IDS,
    EngineContract,
    assert_closed,
    assert_logprobs_match,
    assert_same_completions,
    assert_well_formed,
    seeded,
    token_ids,
)
from transformers import DynamicCache

from echo2swarm.rollout.engines import SamplingParams, make_engine
from echo2swarm.rollout.engines.hf import TransformersEngine
from echo2swarm.wire.sampling import SAMPLER

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path]) -> Iterator[TransformersEngine]:
    built = TransformersEngine(model_dirs["seed0"], threads=1)
    yield built
    built.close()


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> Iterator[dict[str, TransformersEngine]]:
    engines = {name: TransformersEngine(model_dirs[name], threads=1) for name in ("seed0", "seed1")}
    yield engines
    for built in engines.values():
        built.close()


@pytest.fixture
def refit_engine(model_dirs: dict[str, Path]) -> Iterator[TransformersEngine]:
    built = TransformersEngine(model_dirs["seed0"], threads=1)
    yield built
    built.close()


class TestTransformersEngineContract(EngineContract):
    # Against another transformers engine with the same weights, outputs are equal outright.
    greedy_tolerance = 0.0


def test_many_rows_stop_early_and_logprobs_stay_right(
    engine: TransformersEngine, reference: dict[str, TransformersEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2 × 64 rows × 24 tokens: plenty of EOS, so finished rows get dropped mid-batch.
    selections: list[int] = []
    original = DynamicCache.batch_select_indices

    def counting(cache: DynamicCache, indices: torch.Tensor) -> None:
        selections.append(len(indices))
        original(cache, indices)

    monkeypatch.setattr(DynamicCache, "batch_select_indices", counting)
    prompts = ["12+3=", "abc, 99*3-4="]
    groups = engine.generate(prompts, SamplingParams(n=64, max_new_tokens=24, seed=5))

    assert selections[0] == 128  # 2 prefilled prompts fanned out to 128 rows
    assert len(selections) >= 2 and all(later < 128 for later in selections[1:])  # rows were dropped
    reasons = [c.finish_reason for group in groups for c in group]
    assert reasons.count("stop") > 32 and "length" in reasons
    for group in groups:
        for completion in group:
            assert_well_formed(completion, 24)
    sample = [
        [c for c in group if c.finish_reason == "stop"][:4] + [c for c in group if c.finish_reason == "length"][:2]
        for group in groups
    ]
    assert_logprobs_match(reference["seed0"], prompts, sample, 1.0)


def test_sampling_leaves_the_global_rng_alone(engine: TransformersEngine) -> None:
    # Not in the shared contract: vLLM's in-process engine core draws on torch's global generator.
    torch.manual_seed(123)
    global_state = torch.get_rng_state()

    engine.generate(MIXED_PROMPTS, SamplingParams(n=4, max_new_tokens=8, seed=11))
    engine.generate(MIXED_PROMPTS, SamplingParams(n=4, max_new_tokens=8))

    assert torch.equal(torch.get_rng_state(), global_state)  # a local generator only


def test_tiny_top_p_is_greedy(engine: TransformersEngine) -> None:
    # The untrained model is nearly uniform (top token ≈ 0.05 of the mass), so top_p=0.05 can
    # still keep two tokens; any top_p ≤ 1/|vocab| keeps exactly the argmax.
    top_p = 1.0 / (2 * len(engine.tokenizer))
    sampled = engine.generate(MIXED_PROMPTS, SamplingParams(n=4, max_new_tokens=8, top_p=top_p, seed=9))
    greedy = engine.generate(MIXED_PROMPTS, SamplingParams(n=4, max_new_tokens=8, temperature=0.0))

    assert token_ids(sampled) == token_ids(greedy)
    # A one-token nucleus: the token was certain under the distribution it was sampled from.
    assert all(lp == 0.0 for group in sampled for c in group for lp in c.logprobs)


def test_sub_batches_give_the_same_greedy_results(
    model_dirs: dict[str, Path], engine: TransformersEngine, reference: dict[str, TransformersEngine]
) -> None:
    small = make_engine("transformers", model_dirs["seed0"], threads=1, max_batch_sequences=5)
    params = SamplingParams(n=3, max_new_tokens=7, temperature=0.0)
    try:
        expected = engine.generate(MIXED_PROMPTS, params)
        got = small.generate(MIXED_PROMPTS, params)
        sampled = small.generate(MIXED_PROMPTS, SamplingParams(n=3, max_new_tokens=7, seed=2))
    finally:
        small.close()
    assert_same_completions(got, expected, tolerance=1e-5)
    assert [len(g) for g in sampled] == [3] * len(MIXED_PROMPTS)
    assert_logprobs_match(reference["seed0"], MIXED_PROMPTS, sampled, 1.0)


def test_load_weights_copies_into_the_same_parameters(model_dirs: dict[str, Path]) -> None:
    """What the contract's refit test cannot see: the model object and its parameters stay, and the
    tied head follows the embedding although the file holds only the embedding."""
    engine = TransformersEngine(model_dirs["seed0"], threads=1)
    try:
        model, embedding = engine.model, engine.model.get_input_embeddings().weight

        assert engine.load_weights(model_dirs["seed1"]) >= 0.0

        assert engine.model is model and engine.model.get_input_embeddings().weight is embedding
        assert engine.model.lm_head.weight.data_ptr() == embedding.data_ptr()
        # A refused version names both shapes and leaves the same parameters in place.
        wrong_shape = r"model\.layers\.0\.mlp\.up_proj\.weight \(file \(255, 128\), model \(256, 128\)\)"
        with pytest.raises(ValueError, match=wrong_shape):
            engine.load_weights(model_dirs["bad_shape"])
        assert engine.model is model and engine.model.get_input_embeddings().weight is embedding
        assert engine.model.lm_head.weight.data_ptr() == embedding.data_ptr()
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0, "max_new_tokens": 4}, "n"),
        ({"n": 2, "max_new_tokens": 0}, "max_new_tokens"),
        ({"n": 2, "max_new_tokens": 4, "temperature": -0.1}, "temperature"),
        ({"n": 2, "max_new_tokens": 4, "temperature": float("nan")}, "temperature"),
        ({"n": 2, "max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"n": 2, "max_new_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"n": 2.0, "max_new_tokens": 4}, "n"),
        ({"n": 2, "max_new_tokens": 4, "seed": "7"}, "seed"),
        ({"n": 2, "max_new_tokens": 4, "seed": 7, "sampler": "gumbel-other/9", "prompt_ids": ("a",)}, "sampler"),
        ({"n": 2, "max_new_tokens": 4, "sampler": SAMPLER, "prompt_ids": ("a",)}, "sampler"),  # no seed
        ({"n": 2, "max_new_tokens": 4, "seed": 7, "sampler": SAMPLER}, "sampler"),  # no prompt ids
    ],
)
def test_sampling_params_validation(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_seeded_sampling_is_the_same_across_sub_batches(engine: TransformersEngine) -> None:
    """What the contract's seeded test cannot see: sub-batches that cut through groups, sorted by length."""
    prompts, ids = MIXED_PROMPTS[:4], PROMPT_IDS[:4]
    first = engine.generate(prompts, seeded(ids))
    try:
        engine.max_batch_sequences = 3
        reordered = engine.generate(prompts[::-1], seeded(ids[::-1]))[::-1]
    finally:
        engine.max_batch_sequences = 64
    assert_same_completions(reordered, first, 1e-5)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_small_batchs_noise_drawn_ahead_gives_the_tokens_of_the_noise_drawn_step_by_step(
        engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch, top_p: float) -> None:
    from echo2swarm.rollout.engines import hf

    prompts, ids = MIXED_PROMPTS[:4], PROMPT_IDS[:4]
    params = dataclasses.replace(seeded(ids), top_p=top_p)
    drawn = []
    real = hf._noise_ahead
    monkeypatch.setattr(hf, "_noise_ahead", lambda *a: drawn.append(real(*a)) or drawn[-1])
    ahead = engine.generate(prompts, params)
    assert drawn and drawn[0] is not None  # the tiny model's batch is drawn ahead
    monkeypatch.setattr(hf, "NOISE_AHEAD_ELEMENTS", 0)  # every step's noise as it comes
    assert_same_completions(engine.generate(prompts, params), ahead, 1e-5)


def test_sampling_params_accepts_edges() -> None:
    params = SamplingParams(n=1, max_new_tokens=1, temperature=0.0, top_p=1.0, seed=0)
    assert params.greedy
    with pytest.raises(AttributeError):
        params.n = 2  # type: ignore[misc]  # frozen


def test_make_engine_kinds(model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="auto, vllm, transformers"):
        make_engine("vllm-typo", model_dirs["seed0"])

    # "auto" and "vllm" are covered by test_engine_selection.py (and tests/vllm_engine where vllm is installed).
    with caplog.at_level(logging.INFO, logger="echo2swarm.rollout.engines"):
        built = make_engine("transformers", model_dirs["seed0"], threads=1)
    try:
        assert isinstance(built, TransformersEngine) and built.name == "transformers"
        assert "rollout engine: transformers (asked for 'transformers')" in caplog.text
    finally:
        built.close()
    assert_closed(built)
