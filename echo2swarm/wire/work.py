"""Messages of the lease/trajectory RPCs between rollout peers and the learner (msgpack over libp2p).

    rollout ── rpc_lease(LeaseRequest) ──────────────► learner ── Lease | LeaseWait
    rollout ── rpc_submit(stream of GroupSubmission) ► learner ── SubmitResult

Every field is bounded, so a message that parses is also small enough to handle. The sender is
the libp2p peer id the transport authenticated, never a field a peer could forge. Rewards are
not part of any message: the learner computes them from the completion tokens.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_PROMPTS_PER_LEASE = 256
MAX_GROUP_SIZE = 256
MAX_COMPLETION_TOKENS = 8192
MAX_PROMPT_CHARS = 64 * 1024


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class SamplingSpec(_Message):
    n: int = Field(ge=1, le=MAX_GROUP_SIZE)
    max_new_tokens: int = Field(ge=1, le=MAX_COMPLETION_TOKENS)
    temperature: float = Field(ge=0.0, le=10.0)
    top_p: float = Field(gt=0.0, le=1.0)
    seed: int = Field(ge=0, lt=2**63)
    sampler: str | None = Field(None, max_length=64, description="the seeded sampler every completion is drawn "
                                "with, keyed by (seed, prompt id, completion index) (wire/sampling.py); null: the "
                                "engine's own generator, seeded by `seed`")


class LeasePrompt(_Message):
    prompt_id: str = Field(max_length=128)
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class LeaseRequest(_Message):
    max_prompts: int = Field(ge=1, le=MAX_PROMPTS_PER_LEASE)
    held_version: int | None = Field(None, ge=0)
    wait_s: float = Field(0.0, ge=0, le=60, description="hold the request up to this long (capped by the learner's "
                          "leases.max_hold_s) until work is free, rather than answering LeaseWait at once")


class Lease(_Message):
    kind: Literal["lease"] = "lease"
    lease_id: str = Field(max_length=64)
    prompts: list[LeasePrompt] = Field(min_length=1, max_length=MAX_PROMPTS_PER_LEASE)
    sampling: SamplingSpec
    min_version: int = Field(ge=1, description="generate with this version or newer")
    deadline_s: float = Field(gt=0, description="seconds from now until the lease expires and is re-issued")
    head: str | None = Field(None, max_length=16 * 1024, description="the learner's signed head, JSON")
    held_s: float = Field(0.0, ge=0, le=60, description="how long the request was held for lack of work")


class LeaseWait(_Message):
    """No work now: ask again after `retry_s` (back-pressure), or stop asking when `done`."""

    kind: Literal["wait"] = "wait"
    retry_s: float = Field(ge=0, le=60)
    reason: str = Field(max_length=200)
    done: bool = False
    standby: bool = Field(False, description="the learner's plan keeps this peer on standby (cost-aware activation)")
    head: str | None = Field(None, max_length=16 * 1024)
    fetch_first: bool = Field(False, description="work may exist, but not for the version this peer holds")
    capped: bool = Field(False, description="this peer holds as much undelivered work as the learner lets one peer "
                         "hold (open leases, probation): deliver first")
    held_s: float = Field(0.0, ge=0, le=60, description="how long the request was held for lack of work")


class CompletionMsg(_Message):
    token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(max_length=MAX_COMPLETION_TOKENS)
    logprobs: list[float] = Field(max_length=MAX_COMPLETION_TOKENS)
    finish_reason: Literal["stop", "length"]


class GroupSubmission(_Message):
    lease_id: str = Field(max_length=64)
    prompt_id: str = Field(max_length=128)
    version: int = Field(ge=1, description="policy version the completions were generated with")
    completions: list[CompletionMsg] = Field(min_length=1, max_length=MAX_GROUP_SIZE)
    generation_s: float = Field(ge=0, le=86_400)
    sampler: str | None = Field(None, max_length=64, description="the lease's sampler, when the completions were "
                                "drawn with it; null: with the engine's own generator")


class SubmitResult(_Message):
    accepted: int = Field(ge=0)
    refused: dict[str, int] = Field(default_factory=dict)
