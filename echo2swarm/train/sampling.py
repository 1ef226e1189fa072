"""The seeded sampler in torch: the engines' sampling step and the learner's re-derivation of it.

    (k0, k1) per completion (wire/sampling.py `completion_key`), t per position
      ─► `gumbel_noise`: g [R, V], the reference's bits (int64 ops only: same on CPU and CUDA)
      ─► engines:  `sample_seeded`  token = argmax over the nucleus of (logits / T + g)
      ─► learner:  `choice_gaps`    how far below the best perturbed score in the nucleus the sent
                                    token's is, with slack δ for the engines' different logits

The scheme, bit by bit: wire/sampling.py (the pure-Python reference, which a unit test holds this
module equal to) and docs/protocol.md §10.7. A 32-bit multiply mod 2^32 is done in int64 with the
constant split in 16-bit halves, so no product exceeds 2^49 and nothing depends on how a device
wraps an overflow. The noise costs about 30 int64 operations per vocabulary entry and row.
"""

from __future__ import annotations

import math

import torch

from echo2swarm.wire.sampling import LOWBIAS32_M1, LOWBIAS32_M2, MASK32

__all__ = ["choice_gaps", "gumbel_noise", "lowbias32", "nucleus", "sample_seeded", "uniform_bits"]

def _mul32_(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x · constant mod 2^32, in place, for int64 ``x`` in [0, 2^32): each partial product < 2^48."""
    high = x * (constant >> 16)
    high &= 0xFFFF
    high <<= 16
    x *= constant & 0xFFFF
    x += high
    x &= MASK32
    return x


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 of every element of an int64 tensor in [0, 2^32), in place (and returned)."""
    x ^= x >> 16
    _mul32_(x, LOWBIAS32_M1)
    x ^= x >> 15
    _mul32_(x, LOWBIAS32_M2)
    x ^= x >> 16
    return x


def uniform_bits(k0: torch.Tensor, k1: torch.Tensor, t: torch.Tensor, vocab: int) -> torch.Tensor:
    """The PRF's 32-bit words ``[R, vocab]`` (int64) for rows with key words ``k0``, ``k1`` and
    positions ``t`` (each ``[R]``, int64, on the device the words are wanted on)."""
    r = lowbias32(k0 ^ t)
    x = torch.arange(vocab, dtype=torch.int64, device=k0.device).unsqueeze(0) ^ r.unsqueeze(1)
    lowbias32(x)
    x ^= k1.unsqueeze(1)
    return lowbias32(x)


def gumbel_noise(k0: torch.Tensor, k1: torch.Tensor, t: torch.Tensor, vocab: int) -> torch.Tensor:
    """g = -log(-log(u)) ``[R, vocab]`` float32, u = ((x >> 9) + 0.5) · 2^-23 of the PRF's words."""
    x = uniform_bits(k0, k1, t, vocab)
    x >>= 9
    u = x.to(torch.float32)
    del x
    u += 0.5
    u *= 2.0**-23  # exact: a power of two, and (x >> 9) + 0.5 has at most 24 significant bits
    u.log_().neg_().log_().neg_()
    return u


def nucleus(logp: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For log-probabilities ``[..., V]`` and top_p < 1: the log of the nucleus mass ``[..., 1]``
    and the mask of the tokens outside the nucleus ``[..., V]``.

    The engines' rule (rollout/engines/base.py): sorted by probability, a token is kept while the
    mass ranked above it is still short of top_p; the top one always is.
    """
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return torch.logsumexp(logp.masked_fill(drop, -math.inf), dim=-1, keepdim=True), drop


def sample_seeded(scaled: torch.Tensor, noise: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``scaled`` = logits / T ``[R, V]`` (float32) and its behaviour logprob
    (log μ: the nucleus renormalised, rollout/engines/base.py): argmax over the nucleus of
    ``scaled + noise``, the lowest token id among equal scores."""
    logp = torch.log_softmax(scaled, dim=-1)
    scores = scaled + noise
    if top_p < 1.0:
        log_mass, drop = nucleus(logp, top_p)
        token = scores.masked_fill_(drop, -math.inf).argmax(dim=-1)
        return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1) - log_mass.squeeze(-1)
    token = scores.argmax(dim=-1)
    return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)


def choice_gaps(scaled: torch.Tensor, tokens: torch.Tensor, noise: torch.Tensor, top_p: float,
                delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether the sent ``tokens`` ``[P]`` can be the seeded sampler's choices under the logits
    ``scaled`` = logits / T ``[P, V]`` (float32) of the behaviour version, when an engine's logits
    may differ from these by up to ``delta`` in any difference of two tokens' scaled logits.

    Returns (gap ``[P]``, outside ``[P]`` bool): gap = the best perturbed score (scaled + noise)
    over the tokens surely in the engine's nucleus minus the sent token's (an honest engine's is
    at most ``delta``; -inf when no token is surely in it), and outside = the sent token is surely
    not in the engine's nucleus. With top_p = 1 every token is in the nucleus.

    Why these bounds: engine probabilities are then within a factor e^±delta of these, and two
    tokens swap rank only when their log-probabilities are within delta. So the mass the engine
    ranks above a token v is at most e^delta · W(v), W(v) = the mass of the other tokens with
    log p >= log p(v) - delta (ties may rank either way), and at least e^-delta · S(v), S(v) = the
    mass of the tokens with log p > log p(v) + delta: v is surely in the nucleus when
    e^delta · W(v) < top_p, surely out when e^-delta · S(v) >= top_p (docs/protocol.md §10.4.1).
    """
    scores = scaled + noise
    sent = scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if top_p >= 1.0:
        return scores.amax(dim=-1) - sent, torch.zeros_like(tokens, dtype=torch.bool)
    logp = torch.log_softmax(scaled, dim=-1)
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    mass = sorted_p.cumsum(dim=-1)  # mass[i]: the i + 1 most probable tokens
    rising = sorted_logp.neg().contiguous()  # ascending, for searchsorted
    # Tokens with log p >= log p(i) - delta (i and its ties among them), and with log p > log p(i) + delta.
    wide = torch.searchsorted(rising, rising + delta, side="right")
    narrow = torch.searchsorted(rising, rising - delta, side="left")
    above_wide = mass.gather(-1, (wide - 1).clamp_(min=0)) - sorted_p
    above_narrow = torch.where(narrow > 0, mass.gather(-1, (narrow - 1).clamp(min=0)), torch.zeros_like(mass))
    surely_in = above_wide * math.exp(delta) < top_p
    surely_out = above_narrow * math.exp(-delta) >= top_p
    core = torch.empty_like(surely_in).scatter_(-1, order, surely_in)
    out = torch.empty_like(surely_out).scatter_(-1, order, surely_out)
    best = scores.masked_fill_(~core, -math.inf).amax(dim=-1)
    return best - sent, out.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
