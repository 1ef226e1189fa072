"""Messages of the exact-check RPC between the learner and its verifier daemons (msgpack over libp2p).

    learner ── rpc_check(CheckRequest) ──► verifier ── CheckFigures | CheckRefused

A verifier daemon holds the policy's versions as any follower does and computes, for rows the learner
sends, what the learner's own exact check of an older version would (train/exact.py): each completion
token's logprob under the sampling distribution, the row's typicality sums and, for rows drawn with
the seeded sampler, how far the sent tokens' perturbed scores fall below the sampler's choice. The
learner keeps every decision: it compares the figures with the claims and its own tolerances.

Rows are sent without padding: a row is its prompt and completion tokens, and how many of them are
the completion. Every field is bounded, so a message that parses is small enough to handle (one call
holds at most `MAX_CHECK_TOKENS` tokens; the learner splits larger checks).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from echo2swarm.wire.work import MAX_COMPLETION_TOKENS

MAX_CHECK_ROWS = 512
MAX_CHECK_TOKENS = 131_072  # prompt and completion tokens of all rows of one call (~0.6 MB of msgpack)
MAX_ROW_TOKENS = 32_768


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class CheckRow(_Message):
    ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(min_length=2, max_length=MAX_ROW_TOKENS)
    completion: int = Field(ge=1, le=MAX_COMPLETION_TOKENS, description="the last `completion` ids are the completion")
    key: list[int] | None = Field(None, min_length=2, max_length=2, description="the seeded sampler's key words of this completion "
                                        "(wire/sampling.py `completion_key`); null: not drawn with it")

    @model_validator(mode="after")
    def _completion_inside(self) -> "CheckRow":
        if self.completion >= len(self.ids):
            raise ValueError(f"completion of {self.completion} tokens leaves no prompt in {len(self.ids)} ids")
        if self.key is not None and not all(-(2**63) <= k < 2**63 for k in self.key):
            raise ValueError("key words are 64-bit signed integers")
        return self


class CheckRequest(_Message):
    version: int = Field(ge=1, description="the policy version whose logits the figures are of")
    temperature: float = Field(gt=0.0, le=10.0)
    top_p: float = Field(gt=0.0, le=1.0)
    typicality: bool = Field(True, description="also return the typicality sums")
    delta: float = Field(ge=0.0, le=1e6, description="the choice check's δ / T, in logits / T")
    scale: float = Field(gt=0.0, le=1e6, description="the per-peer choice evidence's scale, in logits / T")
    rows: list[CheckRow] = Field(min_length=1, max_length=MAX_CHECK_ROWS)

    @model_validator(mode="after")
    def _bounded(self) -> "CheckRequest":
        total = sum(len(r.ids) for r in self.rows)
        if total > MAX_CHECK_TOKENS:
            raise ValueError(f"{total} tokens in one check (at most {MAX_CHECK_TOKENS}: split it)")
        return self


class RowFigures(_Message):
    logprobs: list[float | None] = Field(max_length=MAX_COMPLETION_TOKENS, description="per completion token; "
                                         "null: -inf (outside the nucleus; JSON has no infinities)")
    excess: float | None = Field(None, description="Σ (surprisal - entropy) over the completion; null without typicality")
    variance: float | None = Field(None, description="Σ Var[-log π] over the completion; null without typicality")
    gap: float | None = Field(None, description="the largest choice gap in logits / T; null: no choice re-derived")
    outside: bool = Field(False, description="a sent token is surely outside the nucleus")
    evidence: float = Field(0.0, ge=0.0, description="Σ choice evidence at `scale` over its positions")
    positions: int = Field(0, ge=0, le=MAX_COMPLETION_TOKENS, description="positions whose choice was re-derived")


class CheckFigures(_Message):
    kind: Literal["figures"] = "figures"
    version: int = Field(ge=1)
    rows: list[RowFigures] = Field(max_length=MAX_CHECK_ROWS)
    compute_s: float = Field(ge=0.0, le=86_400)


class CheckRefused(_Message):
    """Not computed: `reason` one of `not_listed` (the caller is not the learner whose head lists this
    verifier), `not_held` (the version is not installed here), `busy` (checks queued to the bound),
    `failed` (the forward raised: the weights do not fit, a file is damaged)."""

    kind: Literal["refused"] = "refused"
    reason: Literal["not_listed", "not_held", "busy", "failed"]
    detail: str = Field("", max_length=300)
