"""The seeded sampler's reference (wire/sampling.py) against the test vectors docs/protocol.md §10.7
gives an independent implementer."""

from __future__ import annotations

import hashlib
import struct

import pytest
from helpers import protocol_doc as doc

from echo2swarm.wire.sampling import SAMPLER, SAMPLERS, completion_key, gumbel, lowbias32, prf, uniform


def test_the_documented_vectors_are_the_reference_s() -> None:
    rows = doc.sampler_vectors()
    assert len(rows) == 12 and any(not str(r["prompt_id"]).isascii() for r in rows)  # UTF-8 ids covered
    for r in rows:
        assert completion_key(r["seed"], r["prompt_id"], r["j"]) == (r["k0"], r["k1"]), r  # type: ignore[arg-type]
        x = prf(r["k0"], r["k1"], r["t"], r["v"])  # type: ignore[arg-type]
        assert x == r["x"], r
        assert uniform(x) == r["u"] and gumbel(uniform(x)) == r["g"], r  # bit for bit


def test_the_worked_example_and_the_hash_are_as_documented() -> None:
    body = doc.section("10.7")
    message = b"echo2swarm/" + SAMPLER.encode() + b"\x00" + (0).to_bytes(8, "big") + (0).to_bytes(4, "big") + b"train:0"
    assert len(message) == 49 and "49 bytes" in body
    assert hashlib.sha256(message).hexdigest().startswith("b1464dc33a885327b3873011")
    assert f"`{message.hex()[:58]} 00 0000000000000000 00000000 {b'train:0'.hex()}`" in body
    assert lowbias32(0) == 0 and lowbias32(1) == 0x688990C0 and lowbias32(0x12345678) == 0xF5E71C96
    assert "`688990c0`" in body and "`f5e71c96`" in body


def test_uniforms_are_exact_float32_values_strictly_inside_the_unit_interval() -> None:
    def as_f32(value: float) -> float:
        return struct.unpack("<f", struct.pack("<f", value))[0]

    for x in (0, 1, 511, 512, 2**31, 2**32 - 1, 0x9E3779B9):
        u = uniform(x)
        assert 0.0 < u < 1.0 and as_f32(u) == u
    assert uniform(0) == 2.0**-24 and uniform(2**32 - 1) == 1.0 - 2.0**-24
    assert -2.82 < gumbel(uniform(0)) < -2.8 and 16.6 < gumbel(uniform(2**32 - 1)) < 16.7


def test_keys_separate_seeds_prompts_and_completions_and_refuse_what_does_not_fit() -> None:
    keys = {completion_key(seed, pid, j) for seed in (0, 1) for pid in ("train:1", "train:10") for j in (0, 1, 2)}
    assert len(keys) == 12
    assert SAMPLER in SAMPLERS
    with pytest.raises(ValueError):
        completion_key(2**63, "train:0", 0)
    with pytest.raises(ValueError):
        completion_key(-1, "train:0", 0)
    with pytest.raises(ValueError):
        prf(0, 0, -1, 0)
