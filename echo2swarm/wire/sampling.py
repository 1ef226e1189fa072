"""The seeded sampler a lease names: the reference, in plain integers and floats.

Completion j of a leased prompt picks the token at position t as

    token_t = argmax over the nucleus of (logits_t / T + g_t)        (greedy, T = 0: argmax of logits_t)
    g_t[v]  = -log(-log(u)),   u = uniform(prf(key(seed, prompt_id, j), t, v))

so anyone holding the logits can re-derive the choice, on any device, in any batch layout or order:
the noise is a function of those five numbers, not of a generator's state. Gumbel-max draws exactly
from softmax(logits / T) over the nucleus, so the behaviour logprob an engine reports is unchanged
(rollout/engines/base.py). Bit by bit, with test vectors: docs/protocol.md §10.7.

    (seed, prompt_id, j) ─► sha256 ─► key words k0, k1          once per completion (`completion_key`)
    (k0, t)              ─► r = lowbias32(k0 ^ t)               once per position
    (r, k1, v)           ─► x = lowbias32(lowbias32(v ^ r) ^ k1) per vocabulary entry (`prf`)
    x                    ─► u = ((x >> 9) + 0.5) · 2^-23          exact in float32 (`uniform`)
    u                    ─► g = -log(-log(u)), each log in float32 (`gumbel`)

This module is the specification in executable form, and slow: engines and the learner's
verification use the vectorised torch version (train/sampling.py), which a unit test holds equal
to this one.
"""

from __future__ import annotations

import hashlib
import math
import struct

__all__ = ["SAMPLER", "SAMPLERS", "completion_key", "gumbel", "lowbias32", "prf", "uniform"]

SAMPLER = "gumbel-lowbias32/1"
"""The name of the scheme below, as a lease's `SamplingSpec.sampler` carries it."""

SAMPLERS: frozenset[str] = frozenset({SAMPLER})
"""Every seeded sampler this code knows."""

MASK32 = 0xFFFFFFFF
LOWBIAS32_M1 = 0x7FEB352D
LOWBIAS32_M2 = 0x846CA68B
KEY_DOMAIN = b"echo2swarm/" + SAMPLER.encode() + b"\x00"
"""Prefix of the sha256 input: keys of this scheme never equal another scheme's."""


def completion_key(seed: int, prompt_id: str, j: int) -> tuple[int, int]:
    """The two 32-bit key words of completion ``j`` of prompt ``prompt_id`` in a lease with ``seed``.

    sha256(KEY_DOMAIN ‖ seed as 8 bytes big-endian ‖ j as 4 bytes big-endian ‖ prompt_id in UTF-8);
    k0 = digest bytes 0-3, k1 = bytes 4-7, both big-endian.
    """
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2^63), got {seed}")
    if not 0 <= j < 2**32:
        raise ValueError(f"completion index must be in [0, 2^32), got {j}")
    digest = hashlib.sha256(KEY_DOMAIN + seed.to_bytes(8, "big") + j.to_bytes(4, "big")
                            + prompt_id.encode("utf-8")).digest()
    return int.from_bytes(digest[0:4], "big"), int.from_bytes(digest[4:8], "big")


def lowbias32(x: int) -> int:
    """Chris Wellons' 32-bit avalanche hash (a bijection of [0, 2^32))."""
    x &= MASK32
    x ^= x >> 16
    x = (x * LOWBIAS32_M1) & MASK32
    x ^= x >> 15
    x = (x * LOWBIAS32_M2) & MASK32
    x ^= x >> 16
    return x


def prf(k0: int, k1: int, t: int, v: int) -> int:
    """The 32-bit word of position ``t`` (0 = the first generated token) and token id ``v``."""
    if not 0 <= t < 2**32 or not 0 <= v < 2**32:
        raise ValueError(f"position and token id must be in [0, 2^32), got t={t}, v={v}")
    r = lowbias32(k0 ^ t)
    return lowbias32(lowbias32(v ^ r) ^ k1)


def uniform(x: int) -> float:
    """((x >> 9) + 0.5) · 2^-23: the top 23 bits as a float in (0, 1), exact in float32."""
    return ((x >> 9) + 0.5) * 2.0**-23


def _f32(value: float) -> float:
    """``value`` rounded to the nearest float32."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def gumbel(u: float) -> float:
    """-log(-log(u)) as binary32 arithmetic gives it: each log rounded to the nearest float32."""
    inner = _f32(math.log(u))
    return -_f32(math.log(-inner))
