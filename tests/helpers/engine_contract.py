"""The rollout-engine contract (echo2swarm/rollout/engines/base.py) as tests, written once for every engine.

A test module for one engine subclasses :class:`EngineContract` as ``Test…`` (so that pytest
collects it; this module's own class is not collected) and provides these fixtures:

- ``model_dirs``: :func:`helpers.models.engine_model_dirs`;
- ``engine``: the engine under test on ``model_dirs["seed0"]``;
- ``refit_engine``: an engine on ``model_dirs["seed0"]`` whose weights the refit test changes (it
  puts seed0 back before it ends, so this may be ``engine`` itself where building one is dear);
- ``reference``: ``{"seed0": …, "seed1": …}``, transformers engines holding those weights. Every
  logprob is checked against teacher forcing on them: one unpadded, uncached forward pass over
  prompt + completion, the definition the learner relies on (with top_p < 1: the token's
  probability in the nucleus renormalised, worked out here in float64, apart from any engine),
  and every token drawn with the lease's seeded sampler against the draw the learner re-derives
  from those logits (train/sampling.py `sample_seeded`).

and sets ``greedy_tolerance``: how far the engine's greedy logprobs may be from the transformers
engine's, and from its own earlier ones after a refit there and back (0.0: the very same outputs,
as for the transformers engine itself).

The assertion helpers below are what the engine-specific tests use as well.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from echo2swarm.rollout.engines import Completion, Engine, SamplingParams
from echo2swarm.train.sampling import gumbel_noise, sample_seeded
from echo2swarm.wire.sampling import SAMPLER, completion_key

if TYPE_CHECKING:
    from echo2swarm.rollout.engines.hf import TransformersEngine

__all__ = [
    "EOS", "GREEDY", "LEASE_SEED", "LONG_PROMPT", "MIXED_PROMPTS", "PROMPT_IDS", "EngineContract", "assert_closed",
    "assert_logprobs_match", "assert_same_completions", "assert_well_formed", "greedy_reference", "seeded", "seeded_reference",
    "teacher_forced_logprobs", "token_ids",
]

EOS = 2  # the tiny model's only EOS id
MIXED_PROMPTS = ["1", "12+3=", "7+8=", "abc, 99*3-4="]  # lengths 1, 5, 4, 12: real left padding
# 71 tokens: fills two prefix-cache blocks of 32, so a cache that outlives a refit shows.
LONG_PROMPT = "what is 12 + 34 * 5 - 6, and then 7 * 8 + 9, and 10 - 11 * 12? answer: "
GREEDY = SamplingParams(n=2, max_new_tokens=8, temperature=0.0)
PROMPT_IDS = [f"train:{i}" for i in range(len(MIXED_PROMPTS))]
LEASE_SEED = 2**62 + 5  # a lease's seed is 62 bits: its key bytes are all in use


def seeded(prompt_ids: list[str], seed: int = LEASE_SEED, **kw: object) -> SamplingParams:
    """A lease's sampling with its seeded sampler, for prompts with these ids."""
    return SamplingParams(**{"n": 4, "max_new_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": seed,
                             "sampler": SAMPLER, "prompt_ids": tuple(prompt_ids), **kw})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- reference computations


def teacher_forced_logprobs(
    reference: TransformersEngine, prompt: str, completion: list[int], temperature: float, top_p: float = 1.0
) -> list[float]:
    """The behaviour logprob of each completion token (base.py) from one plain forward pass.

    top_p = 1: ``log_softmax(logits / T)[token]``. top_p < 1: ``log(p[token] / nucleus mass)``
    with p = softmax(logits / T) in float64 and the nucleus the tokens whose mass ranked strictly
    above them is < top_p; asserts that every token lies inside its nucleus (an engine that
    samples outside it, or reports the full-softmax logprob, fails here).
    """
    prompt_ids = reference.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = reference.model(torch.tensor([prompt_ids + completion])).logits[0].float()
    start = len(prompt_ids) - 1
    if top_p >= 1.0:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return [logp[start + i, token].item() for i, token in enumerate(completion)]
    out = []
    for i, token in enumerate(completion):
        p = torch.softmax(logits[start + i].double() / temperature, dim=-1)
        above = p[p > p[token]].sum().item()  # the mass ranked strictly above the token
        assert above < top_p + 1e-6, f"token {token} at step {i} is outside the top-p {top_p} nucleus"
        ranked = p.sort(descending=True).values
        mass = ranked[(ranked.cumsum(0) - ranked) < top_p].sum().item()
        out.append(math.log(p[token].item() / mass))
    return out


def seeded_reference(
    reference: TransformersEngine, prompt: str, completion: list[int], params: SamplingParams, prompt_id: str, j: int
) -> list[int]:
    """What the lease's seeded sampler picks after each prefix of ``completion`` (completion ``j`` of the
    prompt ``prompt_id``), from one uncached forward pass: the learner's re-derivation of the choices."""
    assert params.seed is not None
    prompt_ids = reference.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = reference.model(torch.tensor([prompt_ids + completion])).logits[0].float()
    scaled = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(completion)] / params.temperature
    k0, k1 = completion_key(params.seed, prompt_id, j)
    rows = len(completion)
    noise = gumbel_noise(torch.full((rows,), k0), torch.full((rows,), k1), torch.arange(rows), scaled.shape[-1])
    return sample_seeded(scaled, noise, params.top_p)[0].tolist()


def greedy_reference(reference: TransformersEngine, prompt: str, max_new_tokens: int) -> list[int]:
    """Argmax decoding one token at a time, re-running the whole sequence each step."""
    ids = list(reference.tokenizer(prompt)["input_ids"])
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            token = int(reference.model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token == EOS:
                break
    return out


# ---------------------------------------------------------------------------- assertions


def token_ids(groups: list[list[Completion]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in groups]


def assert_well_formed(completion: Completion, max_new_tokens: int) -> None:
    """Lengths, logprob signs and the stop/length semantics of one completion."""
    assert 1 <= len(completion.token_ids) <= max_new_tokens
    assert len(completion.logprobs) == len(completion.token_ids)
    assert all(lp <= 0.0 for lp in completion.logprobs)
    assert EOS not in completion.token_ids[:-1]  # nothing after EOS
    assert (completion.finish_reason == "stop") == (completion.token_ids[-1] == EOS)
    if completion.finish_reason == "length":
        assert len(completion.token_ids) == max_new_tokens


def assert_logprobs_match(
    reference: TransformersEngine, prompts: list[str], groups: list[list[Completion]], temperature: float,
    top_p: float = 1.0,
) -> None:
    """Every reported logprob equals teacher forcing on ``reference`` at ``temperature`` and ``top_p``."""
    for prompt, group in zip(prompts, groups, strict=True):
        for completion in group:
            expected = teacher_forced_logprobs(reference, prompt, completion.token_ids, temperature, top_p)
            assert completion.logprobs == pytest.approx(expected, abs=1e-4), prompt


def assert_same_completions(
    got: list[list[Completion]], expected: list[list[Completion]], tolerance: float = 1e-4
) -> None:
    """Same tokens and finish reasons, logprobs within ``tolerance`` (0.0: equal outright)."""
    if tolerance == 0.0:
        assert got == expected
        return
    assert token_ids(got) == token_ids(expected)
    assert [[c.finish_reason for c in g] for g in got] == [[c.finish_reason for c in g] for g in expected]
    for group_got, group_expected in zip(got, expected):
        for a, b in zip(group_got, group_expected):
            assert a.logprobs == pytest.approx(b.logprobs, abs=tolerance)


def assert_closed(engine: Engine) -> None:
    """A closed engine refuses work and may be closed again."""
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(["1"], SamplingParams(n=1, max_new_tokens=1))
    with pytest.raises(RuntimeError, match="closed"):
        engine.load_weights(Path("/nonexistent"))
    engine.close()


# ---------------------------------------------------------------------------- the contract


class EngineContract:
    """What every engine must do; see the module docstring for the fixtures a subclass provides."""

    greedy_tolerance: float = 1e-4

    def test_is_an_engine_and_checks_its_prompts(self, engine: Engine) -> None:
        assert isinstance(engine, Engine)
        assert engine.generate([], GREEDY) == []
        assert engine.generate([], SamplingParams(n=2, max_new_tokens=3)) == []
        with pytest.raises(ValueError, match="prompt 1"):
            engine.generate(["1+1=", ""], SamplingParams(n=1, max_new_tokens=2))

    # One token is the edge where the first sampled token is also the last.
    @pytest.mark.parametrize("max_new_tokens", [10, 1])
    def test_greedy_is_one_by_one_argmax_with_logprobs_at_t1(
        self, engine: Engine, reference: dict[str, TransformersEngine], max_new_tokens: int
    ) -> None:
        groups = engine.generate(MIXED_PROMPTS, SamplingParams(n=2, max_new_tokens=max_new_tokens, temperature=0.0,
                                                               seed=0))

        assert [len(group) for group in groups] == [2] * len(MIXED_PROMPTS)
        for prompt, group in zip(MIXED_PROMPTS, groups, strict=True):
            expected = greedy_reference(reference["seed0"], prompt, max_new_tokens)
            assert [c.token_ids for c in group] == [expected, expected]
            # n equal completions, yet each its own object: a caller may change one.
            assert group[0] is not group[1] and group[0].token_ids is not group[1].token_ids
            for completion in group:
                assert_well_formed(completion, max_new_tokens)
        assert_logprobs_match(reference["seed0"], MIXED_PROMPTS, groups, 1.0)  # greedy reports T = 1 logprobs

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_sampling_logprobs_seeds_and_stops(
        self, engine: Engine, reference: dict[str, TransformersEngine], temperature: float
    ) -> None:
        params = SamplingParams(n=8, max_new_tokens=8, temperature=temperature, seed=11)
        groups = engine.generate(MIXED_PROMPTS, params)

        assert [len(group) for group in groups] == [8] * len(MIXED_PROMPTS)
        for group in groups:
            for completion in group:
                assert_well_formed(completion, params.max_new_tokens)
            assert len({tuple(c.token_ids) for c in group}) > 1  # n samples, not n copies
        # The random tiny model stops on EOS now and then: both finish reasons occur.
        reasons = {c.finish_reason for group in groups for c in group}
        assert reasons == {"stop", "length"}, reasons
        assert_logprobs_match(reference["seed0"], MIXED_PROMPTS, groups, temperature)

        # Prompts must not share noise: sample i of two prompts of the same length would otherwise
        # pick the same tokens wherever their distributions look alike.
        twins = engine.generate(["12+3=", "12+4="], params)
        assert [c.token_ids for c in twins[0]] != [c.token_ids for c in twins[1]]

        assert engine.generate(MIXED_PROMPTS, params) == groups  # same seed, same completions
        other = engine.generate(MIXED_PROMPTS, SamplingParams(n=8, max_new_tokens=8, temperature=temperature, seed=12))
        assert token_ids(other) != token_ids(groups)

    def test_top_p_logprobs_are_renormalised_over_the_nucleus(
        self, engine: Engine, reference: dict[str, TransformersEngine]
    ) -> None:
        # The untrained tiny model is nearly uniform, so a top-p 0.5 nucleus holds about half the
        # mass: the renormalised logprob is ~0.6 nats above the full-softmax one, far beyond rounding.
        params = SamplingParams(n=4, max_new_tokens=8, temperature=0.8, top_p=0.5, seed=4)
        groups = engine.generate(MIXED_PROMPTS, params)

        for group in groups:
            for completion in group:
                assert_well_formed(completion, params.max_new_tokens)
        assert_logprobs_match(reference["seed0"], MIXED_PROMPTS, groups, 0.8, top_p=0.5)
        lifts = [
            got - full
            for prompt, group in zip(MIXED_PROMPTS, groups) for c in group
            for got, full in zip(c.logprobs, teacher_forced_logprobs(reference["seed0"], prompt, c.token_ids, 0.8))
        ]
        assert min(lifts) > 0.3, min(lifts)  # -log(nucleus mass), never the full-softmax value
        assert engine.generate(MIXED_PROMPTS, params) == groups  # seeded as without top-p

    @pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
    def test_seeded_sampling_is_the_lease_s_draw_in_any_order_or_company(
        self, engine: Engine, reference: dict[str, TransformersEngine], temperature: float, top_p: float
    ) -> None:
        params = seeded(PROMPT_IDS, temperature=temperature, top_p=top_p)
        groups = engine.generate(MIXED_PROMPTS, params)

        assert [len(group) for group in groups] == [4] * len(MIXED_PROMPTS)
        for prompt, prompt_id, group in zip(MIXED_PROMPTS, PROMPT_IDS, groups, strict=True):
            assert len({tuple(c.token_ids) for c in group}) > 1  # each completion its own noise
            for j, completion in enumerate(group):
                assert_well_formed(completion, params.max_new_tokens)
                # Every token is the one the learner re-derives from the lease's seed, the prompt id and j.
                assert completion.token_ids == seeded_reference(reference["seed0"], prompt, completion.token_ids,
                                                                params, prompt_id, j), (prompt, j)
        assert_logprobs_match(reference["seed0"], MIXED_PROMPTS, groups, temperature, top_p)  # the convention

        # The noise is a function of (seed, prompt id, j) alone: the same draw in any order or company.
        reordered = engine.generate(MIXED_PROMPTS[::-1], seeded(PROMPT_IDS[::-1], temperature=temperature,
                                                                top_p=top_p))[::-1]
        alone = [engine.generate([prompt], seeded([prompt_id], temperature=temperature, top_p=top_p))[0]
                 for prompt, prompt_id in zip(MIXED_PROMPTS, PROMPT_IDS)]
        for other in (reordered, alone):
            assert_same_completions(other, groups, 1e-5)
        # Another seed or another prompt id: other completions.
        other_seed = seeded(PROMPT_IDS, seed=LEASE_SEED + 1, temperature=temperature, top_p=top_p)
        assert token_ids(engine.generate(MIXED_PROMPTS, other_seed)) != token_ids(groups)
        other_id = seeded(["train:99", *PROMPT_IDS[1:]], temperature=temperature, top_p=top_p)
        assert token_ids(engine.generate(MIXED_PROMPTS, other_id))[0] != token_ids(groups)[0]

    def test_seeded_sampling_needs_an_id_per_prompt_and_a_sampler_the_engine_has(
        self, engine: Engine, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with pytest.raises(ValueError, match="prompt_ids"):
            engine.generate(MIXED_PROMPTS[:2], seeded(PROMPT_IDS[:1]))
        from echo2swarm.rollout.engines import base

        assert SAMPLER in base.SEEDED_SAMPLERS[engine.name]
        monkeypatch.setitem(base.SEEDED_SAMPLERS, engine.name, frozenset())
        with pytest.raises(ValueError, match="does not implement the sampler"):
            engine.generate(MIXED_PROMPTS[:1], seeded(PROMPT_IDS[:1]))

    def test_refit_in_place(
        self, refit_engine: Engine, reference: dict[str, TransformersEngine], model_dirs: dict[str, Path]
    ) -> None:
        engine = refit_engine
        prompts = [*MIXED_PROMPTS, LONG_PROMPT]
        sampled = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=5)
        before_greedy = engine.generate(prompts, GREEDY)
        before_sampled = engine.generate(prompts, sampled)

        seconds = engine.load_weights(model_dirs["seed1"])

        assert isinstance(seconds, float) and seconds >= 0.0
        # The same prompts again: a prefix cache still holding the old weights' KV would show here.
        after_greedy = engine.generate(prompts, GREEDY)
        expected_greedy = reference["seed1"].generate(prompts, GREEDY)
        assert_same_completions(after_greedy, expected_greedy, self.greedy_tolerance)
        # The random tiny models' greedy tokens often coincide; their logprobs never do.
        drift = max(abs(a - b) for g1, g0 in zip(after_greedy, before_greedy) for c1, c0 in zip(g1, g0)
                    for a, b in zip(c1.logprobs, c0.logprobs))
        assert drift > 0.05
        after_sampled = engine.generate(prompts, sampled)
        assert_logprobs_match(reference["seed1"], prompts, after_sampled, 1.0)
        assert token_ids(after_sampled) != token_ids(before_sampled)

        # Tensors that do not fit are refused, and the weights stay as they were.
        with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight \(file \(255, 128\).*, "
                                             r"model \(256, 128\)"):
            engine.load_weights(model_dirs["bad_shape"])
        assert_same_completions(engine.generate(prompts, GREEDY), expected_greedy, self.greedy_tolerance)
        with pytest.raises(ValueError) as caught:
            engine.load_weights(model_dirs["bad_keys"])
        assert "missing: model.layers.1.mlp.gate_proj.weight" in str(caught.value)
        assert "unexpected: model.layers.1.mlp.gate_proj.weight_typo" in str(caught.value)
        assert_same_completions(engine.generate(prompts, GREEDY), expected_greedy, self.greedy_tolerance)
        with pytest.raises(ValueError, match=r"no \*\.safetensors"):
            engine.load_weights(model_dirs["seed0"].parent)
        with pytest.raises(ValueError, match=r"truncated/model\.safetensors: not a readable safetensors file"):
            engine.load_weights(model_dirs["truncated"])
        assert_same_completions(engine.generate(prompts, GREEDY), expected_greedy, self.greedy_tolerance)

        # And back: the engine leaves with the weights it came with.
        engine.load_weights(model_dirs["seed0"])
        assert_same_completions(engine.generate(prompts, GREEDY), before_greedy, self.greedy_tolerance)
        assert token_ids(engine.generate(prompts, sampled)) == token_ids(before_sampled)
