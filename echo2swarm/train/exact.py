"""What an exact check of a published version measures, wherever it runs: the learner's own device or
a verifier daemon (learner/verifiers.py), which receives the rows over `rpc_check` (wire/checks.py).

    rows of version v ─► v's forward (streamed: train/streamed.py) ─► per row `ExactFigures`:
        logprobs   each completion token's log π_v under the sampling distribution (T, top-p)
        excess     Σ (surprisal - entropy), variance Σ Var[-log π]   (typicality; optional)
        gap, outside, evidence, positions                          (seeded rows: the re-derived choices)

The figures hold no verdict: the learner's `Verifier` (train/verify.py) compares them with what the
peer claimed, under its own tolerances, whichever device computed them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from echo2swarm.train.grpo import completion_logits
from echo2swarm.train.scoring import TokenScores, choice_gaps_of, score_logits
from echo2swarm.wire.checks import MAX_CHECK_ROWS, MAX_CHECK_TOKENS, CheckFigures, CheckRequest, CheckRow, RowFigures

__all__ = ["CheckUnavailable", "ExactFigures", "ExactSettings", "RemoteCheck", "exact_figures", "figures_from_replies", "figures_reply",
           "request_batch", "requests_of", "row_typicality"]


@dataclass(frozen=True)
class ExactSettings:
    """How the figures are computed: the lease's sampling and the choice check's scales (logits / T)."""

    temperature: float
    top_p: float
    typicality: bool
    delta: float
    scale: float


@dataclass
class ExactFigures:
    """Per row of a left-padded ``[R, L]`` batch (all on the CPU but ``logprobs``, which stays where it
    was computed)."""

    logprobs: torch.Tensor  # [R, L] sampling logprobs of the tokens, where the completion mask is set
    excess: torch.Tensor | None  # [R] Σ (surprisal - entropy); None without typicality
    variance: torch.Tensor | None  # [R] Σ Var[-log π]
    gap: torch.Tensor  # [R] the largest re-derived choice gap (-inf: none re-derived)
    outside: torch.Tensor  # [R] bool: a sent token surely outside the nucleus
    evidence: torch.Tensor  # [R] Σ choice evidence
    positions: torch.Tensor  # [R] long: positions re-derived


class CheckUnavailable(Exception):
    """A `RemoteCheck` found no verifier to compute the figures and no room to compute them here."""


RemoteCheck = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", ExactSettings, int],
                       "ExactFigures | None"]
"""(version, input_ids, attention_mask, completion_mask, keys, settings, need_bytes) -> the figures computed
elsewhere, or None: compute them here. ``keys`` is ``[R, 2]`` (rows of unseeded groups all zero) or None;
``need_bytes`` what the local forward is estimated to hold (learner/verifiers.py decides by it). Raises
CheckUnavailable when the check can run neither there nor here."""


def row_typicality(scores: TokenScores, mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per row: Σ (surprisal - entropy) and Σ variance, on the CPU (None without sampling statistics)."""
    if scores.surprisal is None or scores.entropy is None or scores.variance is None:
        return None, None
    zero = torch.zeros_like(scores.surprisal)
    excess = torch.where(mask, scores.surprisal - scores.entropy, zero).sum(dim=1)
    variance = torch.where(mask, scores.variance, zero).sum(dim=1)
    both = torch.stack([excess, variance]).cpu()
    return both[0], both[1]


def exact_figures(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  completion_mask: torch.Tensor, keys: torch.Tensor | None, settings: ExactSettings) -> ExactFigures:
    """``model``'s figures for a left-padded batch (call under ``torch.no_grad()``). Rows whose key
    words are both 0 are not seeded: their choices are not re-derived."""
    rows = input_ids.shape[0]
    scored = completion_logits(model, input_ids, attention_mask, completion_mask, temperature=settings.temperature)
    scores = score_logits(scored, top_p=settings.top_p, typicality=settings.typicality)
    excess, variance = row_typicality(scores, completion_mask.bool())
    gap = torch.full((rows,), -math.inf)
    outside = torch.zeros(rows, dtype=torch.bool)
    evidence = torch.zeros(rows)
    positions = torch.zeros(rows, dtype=torch.long)
    if keys is not None:
        seeded = (keys != 0).any(dim=1).nonzero().squeeze(1)
        if len(seeded):
            found = choice_gaps_of(scored, completion_mask, keys, seeded, top_p=settings.top_p, delta=settings.delta,
                                   scale=settings.scale)
            gap[seeded], outside[seeded] = found.gap.cpu(), found.outside.cpu()
            evidence[seeded], positions[seeded] = found.evidence.cpu(), found.positions.cpu()
    return ExactFigures(scores.sampling_logprobs, excess, variance, gap, outside, evidence, positions)


# -- over the wire (learner/verifiers.py sends, a verifier daemon answers) ------------------------------
def requests_of(version: int, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
                keys: torch.Tensor | None, settings: ExactSettings) -> list[CheckRequest]:
    """The rows of a left-padded batch as `CheckRequest`s, unpadded, in order, each within the wire's bounds."""
    ids, attn, comp = input_ids.cpu(), attention_mask.cpu().bool(), completion_mask.cpu().bool()
    requests: list[CheckRequest] = []
    rows: list[CheckRow] = []
    tokens = 0
    for r in range(ids.shape[0]):
        key = None
        if keys is not None and bool((keys[r] != 0).any()):
            key = [int(keys[r, 0]), int(keys[r, 1])]
        row = CheckRow(ids=ids[r][attn[r]].tolist(), completion=int(comp[r].sum()), key=key)
        if rows and (tokens + len(row.ids) > MAX_CHECK_TOKENS or len(rows) == MAX_CHECK_ROWS):
            requests.append(_request(version, rows, settings))
            rows, tokens = [], 0
        rows.append(row)
        tokens += len(row.ids)
    if rows:
        requests.append(_request(version, rows, settings))
    return requests


def _request(version: int, rows: list[CheckRow], settings: ExactSettings) -> CheckRequest:
    return CheckRequest(version=version, temperature=settings.temperature, top_p=settings.top_p,
                        typicality=settings.typicality, delta=settings.delta, scale=settings.scale, rows=rows)


def request_batch(request: CheckRequest, device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, ExactSettings]:
    """A request's rows as a left-padded batch (input_ids, attention_mask, completion_mask, keys) and its settings."""
    length = max(len(r.ids) for r in request.rows)
    ids = torch.zeros((len(request.rows), length), dtype=torch.long)
    attn = torch.zeros_like(ids)
    comp = torch.zeros_like(ids)
    keys = torch.zeros((len(request.rows), 2), dtype=torch.long)
    for i, row in enumerate(request.rows):
        n = len(row.ids)
        ids[i, length - n:] = torch.tensor(row.ids)
        attn[i, length - n:] = 1
        comp[i, length - row.completion:] = 1
        if row.key is not None:
            keys[i] = torch.tensor(row.key)
    settings = ExactSettings(request.temperature, request.top_p, request.typicality, request.delta, request.scale)
    seeded = keys if any(r.key is not None for r in request.rows) else None
    return ids.to(device), attn.to(device), comp.to(device), seeded, settings


def figures_reply(request: CheckRequest, figures: ExactFigures, completion_mask: torch.Tensor,
                  compute_s: float) -> CheckFigures:
    """The figures of a request's batch (`request_batch`) as the reply, per row its completion's values.
    ValueError when the forward gave NaN (the learner must not judge peers by it)."""
    logprobs, comp = figures.logprobs.cpu(), completion_mask.cpu().bool()
    sums = [t for t in (figures.excess, figures.variance) if t is not None]
    if bool(torch.isnan(logprobs[comp]).any()) or any(bool((~torch.isfinite(t)).any()) for t in sums):
        # -inf is a token outside the nucleus; NaN is a forward gone wrong, never a peer's fault
        raise ValueError("the version's forward gave NaN: no figures")
    rows = []
    for i in range(len(request.rows)):
        values = [v if math.isfinite(v) else None for v in logprobs[i][comp[i]].tolist()]
        positions = int(figures.positions[i])
        rows.append(RowFigures(
            logprobs=values,
            excess=None if figures.excess is None else float(figures.excess[i]),
            variance=None if figures.variance is None else float(figures.variance[i]),
            gap=float(figures.gap[i]) if positions and math.isfinite(float(figures.gap[i])) else None,
            outside=bool(figures.outside[i]), evidence=float(figures.evidence[i]), positions=positions,
        ))
    return CheckFigures(version=request.version, rows=rows, compute_s=round(compute_s, 6))


def figures_from_replies(replies: list[CheckFigures], completion_mask: torch.Tensor) -> ExactFigures:
    """The replies to `requests_of`'s requests, in order, as figures of the learner's batch. ValueError
    when they do not fit it (a row count or a completion length that differs)."""
    comp = completion_mask.cpu().bool()
    rows = [row for reply in replies for row in reply.rows]
    if len(rows) != comp.shape[0]:
        raise ValueError(f"{len(rows)} rows of figures for {comp.shape[0]} rows asked")
    logprobs = torch.zeros(comp.shape, dtype=torch.float32)
    typicality = all(r.excess is not None and r.variance is not None for r in rows)
    excess, variance = torch.zeros(len(rows)), torch.zeros(len(rows))
    gap = torch.full((len(rows),), -math.inf)
    outside = torch.zeros(len(rows), dtype=torch.bool)
    evidence = torch.zeros(len(rows))
    positions = torch.zeros(len(rows), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row.logprobs) != int(comp[i].sum()):
            raise ValueError(f"row {i}: {len(row.logprobs)} logprobs for a completion of {int(comp[i].sum())} tokens")
        logprobs[i, comp[i]] = torch.tensor([-math.inf if v is None else v for v in row.logprobs], dtype=torch.float32)
        if typicality:
            excess[i], variance[i] = row.excess, row.variance  # type: ignore[assignment]
        if row.gap is not None:
            gap[i] = row.gap
        outside[i], evidence[i], positions[i] = row.outside, row.evidence, row.positions
    return ExactFigures(logprobs, excess if typicality else None, variance if typicality else None, gap, outside,
                        evidence, positions)
