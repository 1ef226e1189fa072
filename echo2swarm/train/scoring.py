"""How probable each completion token is under a policy, and how typical a sampled sequence is.

    logits of a forward (grpo.completion_logits) ─► per token: logprob (full softmax), and under
    the sampling distribution μ (softmax(logits / T), top-p nucleus renormalised): log μ(token),
    surprisal, entropy, variance of the surprisal, whether the token lies outside the nucleus
    ─► typicality z per sequence

The learner's verification (verify.py) compares a peer's claimed behaviour logprobs with
`sampling_logprobs` (the engines' convention, rollout/engines/base.py) and refuses sequences
whose z says they are far less probable than sampling gives. With top_p = 1 the two logprobs
are one tensor: nothing is computed for μ beyond what typicality asks for. For groups drawn with
a lease's seeded sampler, `choice_gaps_of` re-derives every choice from the same logits
(train/sampling.py): how far each sent token's perturbed score is below the best in the nucleus,
and the evidence those gaps add up to per sequence (what the learner's per-peer test sums,
learner/evidence.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from echo2swarm.train.grpo import CompletionLogits, completion_logits
from echo2swarm.train.sampling import choice_gaps, gumbel_noise, nucleus

# Added to Σ Var (nats²) under the square root of z: at near-certain positions the variance is ~0
# and a single sampled runner-up would otherwise give an unbounded z. 1 nat² keeps honest z below
# ~9 (see the module docstring) while random text still scores z > 50.
VARIANCE_FLOOR = 1.0

# Positions × vocabulary per chunk of `choice_gaps_of`: its noise and the nucleus bounds hold about
# 40 bytes of scratch per element (int64 words, a sort, two searches), so 2^23 is ~330 MiB.
CHOICE_CHUNK_ELEMENTS = 1 << 23


@dataclass
class TokenScores:
    """Per completion token, ``[B, L]`` and aligned with ``input_ids`` (0 where not scored).

    ``logprobs``: log softmax(logits / T)[token] over the full vocabulary: the policy's own
    logprob (the objective's π, the proximal policy), bit for bit `token_logprobs`'s value.
    ``sampling_logprobs``: log μ(token) under the sampling distribution μ (T, then top-p
    truncation, renormalised over the nucleus): ``logprobs`` minus the log of the nucleus mass,
    the engines' behaviour logprob convention (rollout/engines/base.py) and what a claim is
    compared with; for a token outside the nucleus, the value it would have inside. With top_p = 1
    it is the very tensor ``logprobs`` (the default when left out).
    The rest is None when typicality was not asked for: ``surprisal`` = -log μ(token) (computed
    from a log-softmax, so it may differ from ``-sampling_logprobs`` in the last bits);
    ``entropy`` H(μ); ``variance`` Var_{x~μ}[-log μ(x)]; ``outside``: the token is outside the
    nucleus (an honest engine samples it only by rounding).
    """

    logprobs: torch.Tensor
    surprisal: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    variance: torch.Tensor | None = None
    outside: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor = None  # type: ignore[assignment]  # set in __post_init__ when None

    def __post_init__(self) -> None:
        if self.sampling_logprobs is None:
            self.sampling_logprobs = self.logprobs

    def rows(self, index: torch.Tensor) -> TokenScores:
        picked = {f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                  for f in fields(self)}
        if self.sampling_logprobs is self.logprobs:
            picked["sampling_logprobs"] = None  # stays the same tensor as logprobs
        return TokenScores(**picked)


def _chunk_scores(
    logits: torch.Tensor, targets: torch.Tensor, top_p: float, typicality: bool
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
    """For logits ``[r, n, V]`` (already / T) and targets ``[r, n]``: the log of the nucleus mass
    ``[r, n]`` (None when top_p = 1), and with ``typicality`` (surprisal, entropy, variance, outside)."""
    logp = torch.log_softmax(logits, dim=-1)
    if top_p < 1.0:
        log_mass, drop = nucleus(logp, top_p)
        mass_out: torch.Tensor | None = log_mass.squeeze(-1)
    else:
        log_mass, drop, mass_out = torch.zeros_like(logp[..., :1]), None, None
    if not typicality:
        return mass_out, None
    if drop is not None:
        log_pi = (logp - log_mass).masked_fill(drop, -math.inf)
        outside = drop.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    else:
        log_pi = logp
        outside = torch.zeros_like(targets, dtype=torch.bool)
    pi = log_pi.exp()
    plogpi = torch.where(pi > 0, pi * log_pi, torch.zeros_like(pi))
    entropy = -plogpi.sum(dim=-1)
    centred = torch.where(pi > 0, log_pi + entropy.unsqueeze(-1), torch.zeros_like(pi))
    variance = (pi * centred.square()).sum(dim=-1)
    surprisal = -(logp.gather(-1, targets.unsqueeze(-1)) - log_mass).squeeze(-1)
    return mass_out, (surprisal, entropy, variance, outside)


def score_logits(
    scored: CompletionLogits,
    *,
    top_p: float = 1.0,
    typicality: bool = True,
    logprobs: torch.Tensor | None = None,
    chunk_elements: int = 1 << 25,
) -> TokenScores:
    """Score every completion token from logits a forward already produced (no gradient flows).

    ``logprobs`` (``scored.token_logprobs()``, when the caller has it already) is detached and
    reused. With top_p < 1 (the nucleus mass, for ``sampling_logprobs``) or with ``typicality``
    (the sampling statistics), the logits are processed ``chunk_elements`` at a time (2^25
    floats: 128 MiB of scratch per chunk, a few times over for the top-p sort). With top_p = 1
    and no typicality, nothing beyond ``logprobs`` is computed.
    """
    with torch.no_grad():
        logits = scored.logits.detach()
        detached = CompletionLogits(logits, scored.targets, scored.first, scored.keep)
        logprobs = detached.token_logprobs() if logprobs is None else logprobs.detach()
        truncated = top_p < 1.0
        if not typicality and not truncated:
            return TokenScores(logprobs)
        batch, n = scored.targets.shape
        if n == 0 or logits.shape[1] == 0:  # nothing scored: every logprob is 0, and so is its log μ
            if not typicality:
                return TokenScores(logprobs)
            zeros = torch.zeros_like(logprobs)
            return TokenScores(logprobs, zeros, zeros.clone(), zeros.clone(), zeros.bool())
        masses: list[torch.Tensor] = []
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        rows = max(1, chunk_elements // max(1, n * logits.shape[-1]))
        for start in range(0, batch, rows):
            log_mass, stats = _chunk_scores(logits[start:start + rows], scored.targets[start:start + rows], top_p,
                                            typicality)
            if log_mass is not None:
                masses.append(log_mass)
            for part, value in zip(parts, stats or ()):
                part.append(value)
        # Where not kept, both logprobs and the spread mass are 0: the difference stays 0 there.
        sampling = logprobs - detached.spread(torch.cat(masses)) if truncated else None
        if not typicality:
            return TokenScores(logprobs, sampling_logprobs=sampling)
        surprisal, entropy, variance, outside = (torch.cat(p) for p in parts)
        return TokenScores(
            logprobs, detached.spread(surprisal), detached.spread(entropy), detached.spread(variance),
            detached.spread(outside.float()).bool(), sampling_logprobs=sampling,
        )


class ChoiceGaps(NamedTuple):
    """Per row of a `choice_gaps_of` call (on the logits' device)."""

    gap: torch.Tensor  # the largest gap of any position (-inf when none is defined)
    outside: torch.Tensor  # bool: a sent token is surely outside the nucleus
    evidence: torch.Tensor  # Σ over positions of min(1, (gap / scale)²), 1 for a token surely outside
    positions: torch.Tensor  # positions re-derived


def choice_evidence(gap: torch.Tensor, outside: torch.Tensor, scale: float) -> torch.Tensor:
    """Per position: min(1, (gap / scale)²), and 1 where the sent token is surely outside the nucleus.

    An honest engine's choice is the argmax up to its numeric noise, so most positions give 0 and the
    rest a small fraction of the scale; a sampler that is not the lease's (another temperature, top_p,
    model) moves many choices by more. Squaring keeps the honest noise's share small; the cap at 1
    keeps one position from weighing more than any other far choice (docs/protocol.md §10.4.1).
    With scale = 0 every positive gap counts 1."""
    gap = gap.clamp(min=0).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    weight = (gap > 0).float() if scale <= 0 else (gap / scale).square_().clamp_(max=1.0)
    return torch.where(outside, torch.ones_like(weight), weight)


def choice_gaps_of(
    scored: CompletionLogits,
    completion_mask: torch.Tensor,
    keys: torch.Tensor,
    rows: torch.Tensor,
    *,
    top_p: float,
    delta: float,
    scale: float | None = None,
    chunk_elements: int = CHOICE_CHUNK_ELEMENTS,
) -> ChoiceGaps:
    """Re-derive the seeded sampler's choices of the completion tokens of ``rows`` (``[r]`` long)
    from logits a forward already produced (`choice_gaps` in train/sampling.py, per token).

    ``keys`` (``[B, 2]`` int64): each row's key words (k0, k1); a completion's token at index t
    (0 = its first generated token) gets the noise of position t. Returns, per row of ``rows``,
    the largest gap, whether a sent token is surely outside the nucleus, the summed
    `choice_evidence` at ``scale`` (``delta`` when None; both in the units of logits / T) and the
    number of positions (`ChoiceGaps`).
    """
    with torch.no_grad():
        logits = scored.logits
        device = logits.device
        gaps = torch.full((len(rows),), -math.inf, device=device)
        outside = torch.zeros(len(rows), dtype=torch.bool, device=device)
        evidence = torch.zeros(len(rows), device=device)
        positions = torch.zeros(len(rows), dtype=torch.long, device=device)
        if len(rows) == 0 or logits.shape[1] == 0:
            return ChoiceGaps(gaps, outside, evidence, positions)
        vocab, first = logits.shape[-1], scored.first
        rows, keys = rows.to(device), keys.to(device)
        keep = scored.keep[rows, first:]  # [r, n]: the positions scored
        local, column = keep.nonzero().unbind(1)
        row = rows[local]
        # The completion of row b starts at L - |completion|: token first + column is its index t.
        start = scored.keep.shape[1] - completion_mask[row].sum(dim=1).long()
        t = first + column - start
        step = max(1, chunk_elements // vocab)
        for at in range(0, len(row), step):
            part = slice(at, at + step)
            k = keys[row[part]]
            noise = gumbel_noise(k[:, 0], k[:, 1], t[part], vocab)
            gap, out = choice_gaps(logits[row[part], column[part]], scored.targets[row[part], column[part]], noise,
                                   top_p, delta)
            gaps.scatter_reduce_(0, local[part], gap, "amax")
            outside[local[part][out]] = True
            evidence.scatter_add_(0, local[part], choice_evidence(gap, out, delta if scale is None else scale))
        positions.scatter_add_(0, local, torch.ones_like(local))
        return ChoiceGaps(gaps, outside, evidence, positions)


def score_tokens(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    typicality: bool = True,
    chunk_elements: int = 1 << 25,
) -> TokenScores:
    """One no_grad forward of ``model`` scoring every completion token (see `score_logits`).

    ``logprobs`` equals ``token_logprobs(model, ...)`` (same code path).
    """
    with torch.no_grad():
        scored = completion_logits(model, input_ids, attention_mask, completion_mask, temperature=temperature)
        return score_logits(scored, top_p=top_p, typicality=typicality, chunk_elements=chunk_elements)


def typicality_z(scores: TokenScores, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z of each row and of all rows together: Σ (surprisal - entropy) / sqrt(Σ variance + floor)
    over the tokens where ``mask`` is set. Returns (``[B]`` per sequence, a 0-dim tensor for the lot)."""
    assert scores.surprisal is not None and scores.entropy is not None and scores.variance is not None
    keep = mask.bool()
    zero = torch.zeros_like(scores.surprisal)
    excess = torch.where(keep, scores.surprisal - scores.entropy, zero).sum(dim=1)
    variance = torch.where(keep, scores.variance, zero).sum(dim=1)
    per_row = excess / torch.sqrt(variance + VARIANCE_FLOOR)
    together = excess.sum() / torch.sqrt(variance.sum() + VARIANCE_FLOOR)
    return per_row, together
