"""The seeded sampler in torch: the engines' sampling step and the learner's re-derivation of it.

    (k0, k1) per completion (wire/sampling.py `completion_key`), t per position
      ─► `gumbel_noise`: g [R, V], the reference's bits
      ─► engines:  `seeded_choice`  token = argmax over the nucleus of (logits / T + g), and its
                                    behaviour logprob (`sample_seeded` with g already drawn)
      ─► learner:  `choice_gaps`    how far below the best perturbed score in the nucleus the sent
                                    token's is, with slack δ for the engines' different logits

The scheme, bit by bit: wire/sampling.py (the pure-Python reference, which a unit test holds this
module equal to) and docs/protocol.md §10.7. The words are computed in int32 tensors holding the
bits of the unsigned words: an int32 multiply wraps mod 2^32 on every torch backend (AVX2/AVX-512
`mullo`, CUDA `mul.lo`), and each logical shift is an arithmetic shift with the sign bits masked
off. About 25 passes over 4-byte elements per vocabulary entry and row; on a CPU they run over
blocks of `CPU_BLOCK_ELEMENTS`, which keeps every operand in the core's L2 cache (a pass over a
whole 64 × 152k batch would stream it from memory ~25 times). With top_p < 1 an engine draws the
noise of the nucleus's tokens only.
"""

from __future__ import annotations

import math

import torch

from echo2swarm.wire.sampling import LOWBIAS32_M1, LOWBIAS32_M2, MASK32

__all__ = ["CPU_BLOCK_ELEMENTS", "choice_gaps", "gumbel_noise", "lowbias32", "nucleus", "sample_seeded",
           "seeded_choice", "uniform_bits"]

CPU_BLOCK_ELEMENTS = 1 << 16
"""Rows × vocabulary entries per block of the noise on a CPU: three 4-byte operands of 256 KiB."""


def _signed32(value: int) -> int:
    """The int32 whose bits are the unsigned 32-bit ``value``."""
    return value - (1 << 32) if value >= 1 << 31 else value


_M1, _M2 = _signed32(LOWBIAS32_M1), _signed32(LOWBIAS32_M2)
_UNIFORM_OFFSET = 1.0 - 2.0**-24  # 1.m - (1 - 2^-24) = (m + 0.5) · 2^-23, exact (Sterbenz)


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


def _lowbias32_bits_(x: torch.Tensor, spare: torch.Tensor) -> None:
    """lowbias32 of int32 ``x`` holding unsigned words' bits, in place; ``spare``: scratch of x's shape."""
    for shift, multiplier in ((16, _M1), (15, _M2), (16, None)):
        torch.bitwise_right_shift(x, shift, out=spare)
        spare &= (1 << (32 - shift)) - 1  # the logical shift: no sign bits
        x ^= spare
        if multiplier is not None:
            x *= multiplier


def _key_bits(k0: torch.Tensor, k1: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (int64 ``[R]`` in [0, 2^32)): r = lowbias32(k0 ^ t) and k1, as int32 bits ``[R, 1]``."""
    r = lowbias32(k0 ^ t)
    as_bits = lambda w: (w - ((w >> 31) << 32)).to(torch.int32).unsqueeze(1)  # noqa: E731
    return as_bits(r), as_bits(k1)


def _words_(ids: torch.Tensor, r: torch.Tensor, k1: torch.Tensor, x: torch.Tensor, spare: torch.Tensor) -> None:
    """x = prf(k0, k1, t, v) for token ids ``ids`` (int32, ``[R, C]`` or ``[1, C]``), as int32 bits."""
    torch.bitwise_xor(ids, r, out=x)
    _lowbias32_bits_(x, spare)
    x ^= k1
    _lowbias32_bits_(x, spare)


def _log_neg_log_uniform_(x: torch.Tensor) -> torch.Tensor:
    """log(-log(u)) = -g, u = ((x >> 9) + 0.5) · 2^-23, in place: x's storage as float32 (returned)."""
    x >>= 9
    x &= 0x7FFFFF
    x |= 0x3F800000  # the float32 1.m, m = the word's top 23 bits
    u = x.view(torch.float32)
    u -= _UNIFORM_OFFSET
    return u.log_().neg_().log_()


def _blocks(rows: int, vocab: int, device: torch.device) -> int:
    """Columns per block: the whole vocabulary off the CPU (one kernel per pass), else a cache's worth."""
    return vocab if device.type != "cpu" else max(1, min(vocab, CPU_BLOCK_ELEMENTS // max(rows, 1)))


def _perturb(k0: torch.Tensor, k1: torch.Tensor, t: torch.Tensor, out: torch.Tensor, base: torch.Tensor | None,
             ids: torch.Tensor | None = None) -> torch.Tensor:
    """out = base + g (``base`` None: g) ``[R, C]``, block by block: g of token ids ``ids`` ``[R, C]``,
    or with ``ids`` None of the tokens 0 .. C-1."""
    r, k = _key_bits(k0, k1, t)
    rows, width = out.shape
    columns = _blocks(rows, width, out.device)
    x = torch.empty((rows, columns), dtype=torch.int32, device=out.device)
    spare = torch.empty_like(x)
    for start in range(0, width, columns):
        stop = min(width, start + columns)
        xs = x[:, : stop - start]
        block = (torch.arange(start, stop, dtype=torch.int32, device=out.device).unsqueeze(0) if ids is None
                 else ids[:, start:stop].to(torch.int32))
        _words_(block, r, k, xs, spare[:, : stop - start])
        h = _log_neg_log_uniform_(xs)
        if base is None:
            torch.neg(h, out=out[:, start:stop])
        else:  # a - h is a + (-h) bit for bit
            torch.sub(base[:, start:stop], h, out=out[:, start:stop])
    return out


def uniform_bits(k0: torch.Tensor, k1: torch.Tensor, t: torch.Tensor, vocab: int) -> torch.Tensor:
    """The PRF's 32-bit words ``[R, vocab]`` (int64 in [0, 2^32)) for rows with key words ``k0``, ``k1``
    and positions ``t`` (each ``[R]``, int64, on the device the words are wanted on)."""
    r, k = _key_bits(k0, k1, t)
    x = torch.empty((len(r), vocab), dtype=torch.int32, device=k0.device)
    _words_(torch.arange(vocab, dtype=torch.int32, device=k0.device).unsqueeze(0), r, k, x, torch.empty_like(x))
    return x.to(torch.int64) & MASK32


def gumbel_noise(k0: torch.Tensor, k1: torch.Tensor, t: torch.Tensor, vocab: int) -> torch.Tensor:
    """g = -log(-log(u)) ``[R, vocab]`` float32, u = ((x >> 9) + 0.5) · 2^-23 of the PRF's words."""
    return _perturb(k0, k1, t, torch.empty((len(k0), vocab), dtype=torch.float32, device=k0.device), None)


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


def seeded_choice(scaled: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor, t: torch.Tensor,
                  top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What an engine samples: ``sample_seeded(scaled, gumbel_noise(k0, k1, t, V), top_p)``, the same
    tokens (and logprobs to rounding), drawing only the noise it needs.

    ``scaled`` = logits / T ``[R, V]`` float32; ``k0``, ``k1``, ``t`` ``[R]`` int64 on its device.
    top_p = 1: scaled + g block by block, never the noise alone. top_p < 1: the noise of the
    nucleus's tokens only (sorted by probability, the nucleus is a prefix of each row), the lowest
    token id among equal scores as the argmax over the whole vocabulary gives it.
    """
    logp = torch.log_softmax(scaled, dim=-1)
    if top_p >= 1.0:
        token = _perturb(k0, k1, t, torch.empty_like(scaled), scaled).argmax(dim=-1)
        return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    keep = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p  # nucleus()'s rule, in sorted order
    width = int(keep.sum(dim=-1).max())
    ids, keep = order[:, :width], keep[:, :width]
    gathered = scaled.gather(-1, ids)
    scores = _perturb(k0, k1, t, torch.empty_like(gathered), gathered, ids)
    scores.masked_fill_(~keep, -math.inf)
    best = scores.amax(dim=-1, keepdim=True)
    token = torch.where(scores == best, ids, scaled.shape[-1]).amin(dim=-1)
    log_mass = torch.logsumexp(sorted_logp[:, :width].masked_fill(~keep, -math.inf), dim=-1)
    return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1) - log_mass


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
