"""How probable each completion token is under a policy, and how typical a sampled sequence is.

    logits of a forward (grpo.completion_logits) ─► per token: logprob, and under the sampling
    distribution (softmax(logits / T), top-p nucleus renormalised): surprisal, entropy, variance
    of the surprisal, whether the token lies outside the nucleus ─► typicality z per sequence

The learner's verification (verify.py) compares a peer's claimed logprobs with `logprobs` and
refuses sequences whose z says they are far less probable than sampling gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from echo2swarm.learner.grpo import CompletionLogits, completion_logits

# Added to Σ Var (nats²) under the square root of z: at near-certain positions the variance is ~0
# and a single sampled runner-up would otherwise give an unbounded z. 1 nat² keeps honest z below
# ~9 (see the module docstring) while random text still scores z > 50.
VARIANCE_FLOOR = 1.0


@dataclass
class TokenScores:
    """Per completion token, ``[B, L]`` and aligned with ``input_ids`` (0 where not scored).

    ``logprobs``: log softmax(logits / T)[token] over the full vocabulary: the engines' behaviour
    logprob convention (rollout/engines/base.py), and bit for bit `token_logprobs`'s value.
    The rest is None when typicality was not asked for: ``surprisal`` = -log π(token) under the
    sampling distribution π (T, then top-p truncation, renormalised; for a token outside the
    nucleus, the value it would have inside); ``entropy`` H(π); ``variance`` Var_{x~π}[-log π(x)];
    ``outside``: the token is outside the nucleus (an honest engine samples it only by rounding).
    """

    logprobs: torch.Tensor
    surprisal: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    variance: torch.Tensor | None = None
    outside: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> TokenScores:
        return TokenScores(*(None if t is None else t[index] for t in
                             (self.logprobs, self.surprisal, self.entropy, self.variance, self.outside)))


def _sampling_stats(logits: torch.Tensor, targets: torch.Tensor, top_p: float) -> tuple[torch.Tensor, ...]:
    """For logits ``[r, n, V]`` (already / T) and targets ``[r, n]``: surprisal, entropy, variance, outside."""
    logp = torch.log_softmax(logits, dim=-1)
    if top_p < 1.0:
        # The engine's rule (engines/hf.py `_sample`): sorted by probability, a token is kept while
        # the mass ranked above it is still short of top_p; the top one always is.
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        sorted_p = sorted_logp.exp()
        drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        log_mass = torch.logsumexp(logp.masked_fill(drop, -math.inf), dim=-1, keepdim=True)
        log_pi = (logp - log_mass).masked_fill(drop, -math.inf)
        outside = drop.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    else:
        log_mass = torch.zeros_like(logp[..., :1])
        log_pi = logp
        outside = torch.zeros_like(targets, dtype=torch.bool)
    pi = log_pi.exp()
    plogpi = torch.where(pi > 0, pi * log_pi, torch.zeros_like(pi))
    entropy = -plogpi.sum(dim=-1)
    centred = torch.where(pi > 0, log_pi + entropy.unsqueeze(-1), torch.zeros_like(pi))
    variance = (pi * centred.square()).sum(dim=-1)
    surprisal = -(logp.gather(-1, targets.unsqueeze(-1)) - log_mass).squeeze(-1)
    return surprisal, entropy, variance, outside


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
    reused. With ``typicality``, the sampling statistics are computed ``chunk_elements`` logits at
    a time (2^25 floats: 128 MiB of scratch per chunk, a few times over for the top-p sort).
    """
    with torch.no_grad():
        logits = scored.logits.detach()
        detached = CompletionLogits(logits, scored.targets, scored.first, scored.keep)
        logprobs = detached.token_logprobs() if logprobs is None else logprobs.detach()
        if not typicality:
            return TokenScores(logprobs)
        batch, n = scored.targets.shape
        if n == 0 or logits.shape[1] == 0:
            zeros = torch.zeros_like(logprobs)
            return TokenScores(logprobs, zeros, zeros.clone(), zeros.clone(), zeros.bool())
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        rows = max(1, chunk_elements // max(1, n * logits.shape[-1]))
        for start in range(0, batch, rows):
            stats = _sampling_stats(logits[start:start + rows], scored.targets[start:start + rows], top_p)
            for part, value in zip(parts, stats):
                part.append(value)
        surprisal, entropy, variance, outside = (torch.cat(p) for p in parts)
        return TokenScores(
            logprobs, detached.spread(surprisal), detached.spread(entropy), detached.spread(variance),
            detached.spread(outside.float()).bool(),
        )


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
