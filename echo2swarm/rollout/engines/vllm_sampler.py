"""Our sampling step inside vLLM: a v1 logits processor that decides each token the way base.py does.

    VLLMEngine.generate: every request carries ``extra_args[SAMPLING_ARG]`` = {temperature, top_p, key}
        ─► LeaseSampler.update_state: per batch row, the request's sampling and vLLM's running list
           of its output ids (its length is the position t of the token being drawn)
        ─► LeaseSampler.apply, on the float32 logits of every row, before vLLM's own sampling:
             seeded (a key): token, logprob = seeded_choice(logits / T, k0, k1, t, top_p)
                             (train/sampling.py, as the transformers engine), the request greedy
             greedy (T = 0): token = argmax of the logits, logprob at T = 1
                 ─► for both, the row becomes -inf everywhere but the token, which holds its logprob
             otherwise:      the row becomes log μ (logits / T, log-softmaxed over the nucleus, -inf
                             outside it), and vLLM draws from it with its own generator at T = 1
        ─► vLLM (`logprobs_mode="processed_logits"`): argmax or its draw, and it reports the value of
           the chosen token in the row as it left the processors, i.e. the behaviour logprob

Why this shape: vLLM reports a logprob of the very row it samples from, and no row that a greedy
argmax (or any vLLM draw) picks our token from has our logprob as its log-softmax. In
``processed_logits`` mode vLLM reports the row's value itself, so the row can carry the token's
logprob as the value that makes it the argmax. The logits reach the processor in float32 after
vLLM's own processing, of which the engine asks for none (no penalties, bias, bad words or
min_tokens), so they are the model's logits, as the transformers engine samples from.

Runs in vLLM's worker (the engine-core process when vLLM runs one): imported only once vLLM is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from vllm import SamplingParams as VLLMSamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from echo2swarm.train.sampling import nucleus, seeded_choice

__all__ = ["SAMPLING_ARG", "LeaseSampler", "sampling_arg"]

SAMPLING_ARG = "echo2swarm_sampling"
"""The key of ``SamplingParams.extra_args`` that carries a request's sampling to the processor."""


def sampling_arg(temperature: float, top_p: float, key: tuple[int, int] | None) -> dict[str, Any]:
    """A request's ``extra_args``: its lease's temperature and top_p, and its seeded-sampler key words."""
    return {SAMPLING_ARG: {"temperature": float(temperature), "top_p": float(top_p),
                           "key": None if key is None else [int(key[0]), int(key[1])]}}


@dataclass(frozen=True)
class _Request:
    temperature: float
    top_p: float
    key: tuple[int, int] | None
    output_ids: list[int]  # vLLM's own running list: its length is the position of the next token

    @property
    def kind(self) -> str:
        return "greedy" if self.temperature == 0.0 else ("seeded" if self.key is not None else "vllm")


@dataclass(frozen=True)
class _Group:
    """Rows that share kind, temperature and top_p: one vectorised step."""

    kind: str
    temperature: float
    top_p: float
    rows: torch.Tensor  # [R] long, on the logits' device
    requests: tuple[_Request, ...]
    k0: torch.Tensor | None  # [R] int64, seeded rows only
    k1: torch.Tensor | None


class LeaseSampler(LogitsProcessor):
    """vLLM v1 logits processor (``LLM(logits_processors=[LeaseSampler], logprobs_mode="processed_logits")``)
    for requests built with :func:`sampling_arg`; see the module docstring."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.requests: dict[int, _Request] = {}  # batch row -> request
        self._groups: list[_Group] | None = []

    @classmethod
    def validate_params(cls, sampling_params: VLLMSamplingParams) -> None:
        spec = (sampling_params.extra_args or {}).get(SAMPLING_ARG)
        # Every request of this engine needs it: without, vLLM would report raw logits as logprobs.
        if not isinstance(spec, dict) or set(spec) != {"temperature", "top_p", "key"}:
            raise ValueError(f"every request needs extra_args[{SAMPLING_ARG!r}] (rollout/engines/vllm_sampler.py)")
        key = spec["key"]
        if key is not None and (len(key) != 2 or not all(isinstance(w, int) and 0 <= w < 2**32 for w in key)):
            raise ValueError(f"extra_args[{SAMPLING_ARG!r}]['key'] must be two 32-bit words, got {key!r}")
        decided = spec["temperature"] == 0.0 or key is not None  # the processor picks the token
        if decided and sampling_params.temperature != 0.0:
            raise ValueError("a greedy or seeded request must be greedy in vLLM: the processor decides its token")
        if not decided and (sampling_params.temperature != 1.0 or sampling_params.top_p != 1.0):
            raise ValueError("an unseeded request must ask vLLM for T = 1 and top_p = 1: the processor applies both")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.requests, batch_update, self._new_request):
            self._groups = None

    @staticmethod
    def _new_request(params: VLLMSamplingParams, _prompt_ids: list[int] | None, output_ids: list[int]) -> _Request:
        spec = (params.extra_args or {})[SAMPLING_ARG]
        key = spec["key"]
        return _Request(float(spec["temperature"]), float(spec["top_p"]), None if key is None else (key[0], key[1]),
                        output_ids)

    def _grouped(self) -> list[_Group]:
        if self._groups is None:
            by_setting: dict[tuple[str, float, float], list[tuple[int, _Request]]] = {}
            for row, request in sorted(self.requests.items()):
                by_setting.setdefault((request.kind, request.temperature, request.top_p), []).append((row, request))
            self._groups = []
            for (kind, temperature, top_p), members in by_setting.items():
                rows = torch.tensor([row for row, _ in members], dtype=torch.long, device=self.device)
                keys = (torch.tensor([r.key for _, r in members], dtype=torch.long, device=self.device)
                        if kind == "seeded" else None)
                self._groups.append(_Group(kind, temperature, top_p, rows, tuple(r for _, r in members),
                                           keys[:, 0] if keys is not None else None,
                                           keys[:, 1] if keys is not None else None))
        return self._groups

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for group in self._grouped():
            rows = group.rows
            raw = logits.index_select(0, rows)
            if group.kind == "vllm":
                logp = torch.log_softmax(raw / group.temperature, dim=-1)
                if group.top_p < 1.0:
                    log_mass, drop = nucleus(logp, group.top_p)
                    logp = (logp - log_mass).masked_fill_(drop, -math.inf)
                logits.index_copy_(0, rows, logp)
                continue
            if group.kind == "greedy":
                token = raw.argmax(dim=-1)
                logprob = torch.log_softmax(raw, dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
            else:
                assert group.k0 is not None and group.k1 is not None
                position = torch.tensor([len(r.output_ids) for r in group.requests], dtype=torch.long)
                token, logprob = seeded_choice(raw / group.temperature, group.k0, group.k1,
                                               position.to(self.device, non_blocking=True), group.top_p)
            logits.index_fill_(0, rows, -math.inf)
            logits.index_put_((rows, token), logprob)
        return logits
