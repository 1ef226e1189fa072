"""Tests for the transformers rollout engine on the tiny model.

Every logprob the engine reports is checked against one unpadded, uncached forward pass over
prompt + completion (teacher forcing): that is the definition the learner relies on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from echo2swarm.rollout.engines import Completion, Engine, SamplingParams, make_engine
from echo2swarm.rollout.engines.hf import TransformersEngine

EOS = 2
MIXED_PROMPTS = ["1", "12+3=", "7+8=", "abc, 99*3-4="]  # lengths 1, 5, 4, 12: real left padding
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path]) -> Iterator[TransformersEngine]:
    built = TransformersEngine(model_dirs["seed0"], threads=1)
    yield built
    built.close()


def teacher_forced_logprobs(
    engine: TransformersEngine, prompt: str, completion: list[int], temperature: float
) -> list[float]:
    """log_softmax(logits / T) of each completion token from one plain forward pass."""
    prompt_ids = engine.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt_ids + completion])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prompt_ids) - 1
    return [logp[start + i, token].item() for i, token in enumerate(completion)]


def greedy_reference(engine: TransformersEngine, prompt: str, max_new_tokens: int) -> list[int]:
    """Argmax decoding one token at a time, re-running the whole sequence each step."""
    ids = list(engine.tokenizer(prompt)["input_ids"])
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            token = int(engine.model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token == EOS:
                break
    return out


def assert_well_formed(completion: Completion, max_new_tokens: int) -> None:
    assert 1 <= len(completion.token_ids) <= max_new_tokens
    assert len(completion.logprobs) == len(completion.token_ids)
    assert all(lp <= 0.0 for lp in completion.logprobs)
    assert EOS not in completion.token_ids[:-1]  # nothing after EOS
    assert (completion.finish_reason == "stop") == (completion.token_ids[-1] == EOS)
    if completion.finish_reason == "length":
        assert len(completion.token_ids) == max_new_tokens


def assert_logprobs_match(
    engine: TransformersEngine, prompts: list[str], groups: list[list[Completion]], temperature: float
) -> None:
    for prompt, group in zip(prompts, groups):
        for completion in group:
            expected = teacher_forced_logprobs(engine, prompt, completion.token_ids, temperature)
            assert completion.logprobs == pytest.approx(expected, abs=1e-4), prompt


def test_generate_shapes_and_stop_semantics(engine: TransformersEngine) -> None:
    groups = engine.generate(["12+3=", "7+8="], SamplingParams(n=4, max_new_tokens=6, seed=1))

    assert len(groups) == 2
    assert all(len(group) == 4 for group in groups)
    for group in groups:
        for completion in group:
            assert_well_formed(completion, 6)
    assert engine.generate([], SamplingParams(n=2, max_new_tokens=3)) == []
    assert isinstance(engine, Engine)


def test_many_rows_stop_early_and_logprobs_stay_right(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch
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
    assert_logprobs_match(engine, prompts, sample, 1.0)


def test_same_seed_same_output_different_seed_differs(engine: TransformersEngine) -> None:
    params = SamplingParams(n=4, max_new_tokens=8, seed=11)
    torch.manual_seed(123)
    global_state = torch.get_rng_state()

    first = engine.generate(MIXED_PROMPTS, params)
    second = engine.generate(MIXED_PROMPTS, params)
    other = engine.generate(MIXED_PROMPTS, SamplingParams(n=4, max_new_tokens=8, seed=12))

    assert first == second
    assert [[c.token_ids for c in g] for g in first] != [[c.token_ids for c in g] for g in other]
    assert torch.equal(torch.get_rng_state(), global_state)  # a local generator only


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forcing_with_mixed_prompt_lengths(
    engine: TransformersEngine, temperature: float
) -> None:
    groups = engine.generate(MIXED_PROMPTS, SamplingParams(n=3, max_new_tokens=10, temperature=temperature, seed=3))

    assert_logprobs_match(engine, MIXED_PROMPTS, groups, temperature)


def test_top_p_logprobs_are_taken_before_truncation(engine: TransformersEngine) -> None:
    groups = engine.generate(MIXED_PROMPTS, SamplingParams(n=3, max_new_tokens=8, temperature=0.8, top_p=0.5, seed=4))

    assert_logprobs_match(engine, MIXED_PROMPTS, groups, 0.8)


def test_greedy_equals_one_by_one_argmax(engine: TransformersEngine) -> None:
    groups = engine.generate(MIXED_PROMPTS, SamplingParams(n=2, max_new_tokens=10, temperature=0.0, seed=0))

    for prompt, group in zip(MIXED_PROMPTS, groups):
        expected = greedy_reference(engine, prompt, 10)
        assert [c.token_ids for c in group] == [expected, expected]
    assert_logprobs_match(engine, MIXED_PROMPTS, groups, 1.0)  # greedy reports T = 1 logprobs


def test_tiny_top_p_is_greedy(engine: TransformersEngine) -> None:
    # The untrained model is nearly uniform (top token ≈ 0.05 of the mass), so top_p=0.05 can
    # still keep two tokens; any top_p ≤ 1/|vocab| keeps exactly the argmax.
    top_p = 1.0 / (2 * len(engine.tokenizer))
    sampled = engine.generate(MIXED_PROMPTS, SamplingParams(n=4, max_new_tokens=8, top_p=top_p, seed=9))
    greedy = engine.generate(MIXED_PROMPTS, SamplingParams(n=4, max_new_tokens=8, temperature=0.0))

    assert [[c.token_ids for c in g] for g in sampled] == [[c.token_ids for c in g] for g in greedy]


def test_sub_batches_give_the_same_greedy_results(model_dirs: dict[str, Path], engine: TransformersEngine) -> None:
    small = make_engine("transformers", model_dirs["seed0"], threads=1, max_batch_sequences=5)
    params = SamplingParams(n=3, max_new_tokens=7, temperature=0.0)
    try:
        expected = engine.generate(MIXED_PROMPTS, params)
        got = small.generate(MIXED_PROMPTS, params)
        sampled = small.generate(MIXED_PROMPTS, SamplingParams(n=3, max_new_tokens=7, seed=2))
    finally:
        small.close()
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in expected]
    for group_got, group_expected in zip(got, expected):
        for a, b in zip(group_got, group_expected):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert [len(g) for g in sampled] == [3] * len(MIXED_PROMPTS)
    assert_logprobs_match(engine, MIXED_PROMPTS, sampled, 1.0)


def test_load_weights_swaps_in_place(model_dirs: dict[str, Path]) -> None:
    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
    engine = TransformersEngine(model_dirs["seed0"], threads=1)
    fresh = TransformersEngine(model_dirs["seed1"], threads=1)
    try:
        model, embedding = engine.model, engine.model.get_input_embeddings().weight
        before = engine.generate(MIXED_PROMPTS, greedy)

        seconds = engine.load_weights(model_dirs["seed1"])

        assert seconds >= 0.0
        assert engine.model is model and engine.model.get_input_embeddings().weight is embedding
        # The tied head follows the embedding although the file holds only the embedding.
        assert engine.model.lm_head.weight.data_ptr() == embedding.data_ptr()
        after = engine.generate(MIXED_PROMPTS, greedy)
        assert after == fresh.generate(MIXED_PROMPTS, greedy)
        assert after != before
    finally:
        engine.close()
        fresh.close()


def test_load_weights_rejects_bad_tensors_and_keeps_old_weights(
    model_dirs: dict[str, Path], engine: TransformersEngine
) -> None:
    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
    before = engine.generate(MIXED_PROMPTS, greedy)

    wrong_shape = r"model\.layers\.0\.mlp\.up_proj\.weight \(file \(255, 128\), model \(256, 128\)\)"
    with pytest.raises(ValueError, match=wrong_shape):
        engine.load_weights(model_dirs["bad_shape"])
    assert engine.generate(MIXED_PROMPTS, greedy) == before

    with pytest.raises(ValueError) as caught:
        engine.load_weights(model_dirs["bad_keys"])
    message = str(caught.value)
    assert "missing: model.layers.1.mlp.gate_proj.weight" in message
    assert "unexpected: model.layers.1.mlp.gate_proj.weight_typo" in message
    assert engine.generate(MIXED_PROMPTS, greedy) == before

    with pytest.raises(ValueError, match="no \\*.safetensors"):
        engine.load_weights(model_dirs["seed0"].parent)

    with pytest.raises(ValueError, match=r"truncated/model\.safetensors: not a readable safetensors file"):
        engine.load_weights(model_dirs["truncated"])
    assert engine.generate(MIXED_PROMPTS, greedy) == before


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
    ],
)
def test_sampling_params_validation(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_accepts_edges() -> None:
    params = SamplingParams(n=1, max_new_tokens=1, temperature=0.0, top_p=1.0, seed=0)
    assert params.greedy
    with pytest.raises(AttributeError):
        params.n = 2  # type: ignore[misc]  # frozen


def test_empty_prompt_is_rejected(engine: TransformersEngine) -> None:
    with pytest.raises(ValueError, match="prompt 1"):
        engine.generate(["1+1=", ""], SamplingParams(n=1, max_new_tokens=2))


def test_make_engine_kinds(model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="auto, vllm, transformers"):
        make_engine("vllm-typo", model_dirs["seed0"])

    # "auto" and "vllm" are covered by test_engine_selection.py (and tests/vllm where vllm is installed).
    with caplog.at_level(logging.INFO, logger="echo2swarm.rollout.engines"):
        built = make_engine("transformers", model_dirs["seed0"], threads=1)
    try:
        assert isinstance(built, TransformersEngine) and built.name == "transformers"
        assert "rollout engine: transformers (asked for 'transformers')" in caplog.text
    finally:
        built.close()
    with pytest.raises(RuntimeError, match="closed"):
        built.generate(["1"], SamplingParams(n=1, max_new_tokens=1))
