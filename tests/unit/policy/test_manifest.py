"""Manifests, head records and their verification (echo2swarm/policy/manifest.py)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save as save_safetensors

from echo2swarm.policy.manifest import (
    ChunkRef,
    FileEntry,
    Manifest,
    ManifestError,
    SignedManifest,
    file_entry,
    safetensors_tensors,
    sha256_hex,
    split_chunks,
    verify_head,
    verify_manifest,
)
from echo2swarm.wire.records import HeadRecord, RecordError, parse_head
from echo2swarm.wire.signing import PolicyKey

SWARM = "demo"
CHUNK = 4
PEER_ID = "12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"


@pytest.fixture(scope="module")
def key() -> PolicyKey:
    return PolicyKey.generate()


@pytest.fixture(scope="module")
def other_key() -> PolicyKey:
    return PolicyKey.generate()


def make_manifest(version: int = 3, swarm: str = SWARM) -> Manifest:
    weights, _ = file_entry("model.safetensors", b"0123456789", CHUNK)
    config, _ = file_entry("config.json", b"{}", CHUNK)
    return Manifest(swarm=swarm, version=version, created_ms=1_700_000_000_000, chunk_size=CHUNK, files=[weights, config])


def make_head(data: bytes, key: PolicyKey, version: int = 3, swarm: str = SWARM) -> HeadRecord:
    return HeadRecord(
        swarm=swarm, version=version, manifest_sha256=sha256_hex(data), manifest_size=len(data),
        publisher=PEER_ID, published_ms=1_700_000_000_500, expires_ms=1_700_000_030_500, public_key=key.public.text,
    ).signed(key)


def envelope_and_head(key: PolicyKey, version: int = 3) -> tuple[bytes, HeadRecord]:
    data = SignedManifest.sign(make_manifest(version), key).to_bytes()
    return data, make_head(data, key, version)


def reason(excinfo: pytest.ExceptionInfo[RecordError]) -> str:
    return excinfo.value.reason


# --- heads -----------------------------------------------------------------------------------

def test_good_head_verifies(key: PolicyKey) -> None:
    _, head = envelope_and_head(key)
    assert head.signature_ok()
    verify_head(head, trusted=key.public, swarm=SWARM, held_version=2)
    verify_head(head, trusted=None, swarm=SWARM, held_version=None)


def test_head_round_trips_through_parse_head(key: PolicyKey) -> None:
    _, head = envelope_and_head(key)
    assert parse_head(head.model_dump(mode="json")) == head
    with pytest.raises(RecordError) as e:
        parse_head([1, 2])
    assert reason(e) == "malformed"
    with pytest.raises(RecordError) as e:
        parse_head({**head.model_dump(mode="json"), "extra": 1})
    assert reason(e) == "malformed"


def test_signed_refuses_a_foreign_public_key(key: PolicyKey, other_key: PolicyKey) -> None:
    _, head = envelope_and_head(key)
    with pytest.raises(ValueError):
        head.signed(other_key)


def test_head_for_another_swarm(key: PolicyKey) -> None:
    _, head = envelope_and_head(key)
    with pytest.raises(ManifestError) as e:
        verify_head(head, trusted=key.public, swarm="other", held_version=None)
    assert reason(e) == "wrong_swarm"


def test_head_by_untrusted_key(key: PolicyKey, other_key: PolicyKey) -> None:
    _, head = envelope_and_head(other_key)
    with pytest.raises(ManifestError) as e:
        verify_head(head, trusted=key.public, swarm=SWARM, held_version=None)
    assert reason(e) == "untrusted_key"


@pytest.mark.parametrize(
    "update",
    [{"version": 4}, {"manifest_sha256": "0" * 64}, {"publisher": "12D3KooWother"}, {"swarm": "demo2"},
     {"signature": ""}, {"signature": "ab" * 64}],
)
def test_tampered_head_has_a_bad_signature(key: PolicyKey, update: dict[str, object]) -> None:
    _, head = envelope_and_head(key)
    tampered = head.model_copy(update=update)
    assert not tampered.signature_ok()
    with pytest.raises(ManifestError) as e:
        verify_head(tampered, trusted=key.public, swarm=tampered.swarm, held_version=None)
    assert reason(e) == "bad_signature"


def test_head_with_one_signature_byte_changed(key: PolicyKey) -> None:
    _, head = envelope_and_head(key)
    sig = bytearray(bytes.fromhex(head.signature))
    sig[10] ^= 0xFF
    with pytest.raises(ManifestError) as e:
        verify_head(head.model_copy(update={"signature": sig.hex()}), trusted=key.public, swarm=SWARM, held_version=None)
    assert reason(e) == "bad_signature"


@pytest.mark.parametrize("held", [3, 4, 100])
def test_head_not_newer_than_held_is_stale(key: PolicyKey, held: int) -> None:
    _, head = envelope_and_head(key, version=3)
    with pytest.raises(ManifestError) as e:
        verify_head(head, trusted=key.public, swarm=SWARM, held_version=held)
    assert reason(e) == "stale_version"


# --- manifests -------------------------------------------------------------------------------

def test_good_manifest_verifies(key: PolicyKey) -> None:
    data, head = envelope_and_head(key)
    manifest = verify_manifest(data, head, trusted=key.public, swarm=SWARM)
    assert manifest == make_manifest()
    assert manifest.total_bytes == 12


def test_manifest_bytes_not_matching_the_head(key: PolicyKey) -> None:
    data, head = envelope_and_head(key)
    with pytest.raises(ManifestError) as e:
        verify_manifest(data + b" ", head, trusted=key.public, swarm=SWARM)
    assert reason(e) == "hash_mismatch"


def test_forged_manifest_with_old_signature(key: PolicyKey) -> None:
    signed = SignedManifest.sign(make_manifest(), key)
    forged_manifest = signed.manifest.model_copy(update={"created_ms": 1})
    forged = SignedManifest(manifest=forged_manifest, public_key=signed.public_key, signature=signed.signature).to_bytes()
    # A head that matches the forged bytes, so only the signature check can catch it.
    head = make_head(forged, key)
    with pytest.raises(ManifestError) as e:
        verify_manifest(forged, head, trusted=key.public, swarm=SWARM)
    assert reason(e) == "bad_signature"


def test_manifest_signed_by_another_key(key: PolicyKey, other_key: PolicyKey) -> None:
    data = SignedManifest.sign(make_manifest(), other_key).to_bytes()
    with pytest.raises(ManifestError) as e:
        verify_manifest(data, make_head(data, key), trusted=key.public, swarm=SWARM)
    assert reason(e) == "untrusted_key"


def test_manifest_claiming_trusted_key_but_signed_by_another(key: PolicyKey, other_key: PolicyKey) -> None:
    signed = SignedManifest.sign(make_manifest(), other_key)
    data = signed.model_copy(update={"public_key": key.public.text}).to_bytes()
    with pytest.raises(ManifestError) as e:
        verify_manifest(data, make_head(data, key), trusted=key.public, swarm=SWARM)
    assert reason(e) == "bad_signature"


def test_manifest_for_another_swarm(key: PolicyKey) -> None:
    data = SignedManifest.sign(make_manifest(swarm="other"), key).to_bytes()
    with pytest.raises(ManifestError) as e:
        verify_manifest(data, make_head(data, key), trusted=key.public, swarm=SWARM)
    assert reason(e) == "wrong_swarm"


def test_manifest_version_differs_from_head(key: PolicyKey) -> None:
    data = SignedManifest.sign(make_manifest(version=2), key).to_bytes()
    with pytest.raises(ManifestError) as e:
        verify_manifest(data, make_head(data, key, version=3), trusted=key.public, swarm=SWARM)
    assert reason(e) == "version_mismatch"


@pytest.mark.parametrize("data", [b"not json at all", b"\xff\xfe\x00", b"[]", b'{"manifest": {}}'])
def test_malformed_manifest_bytes(key: PolicyKey, data: bytes) -> None:
    with pytest.raises(ManifestError) as e:
        verify_manifest(data, make_head(data, key), trusted=key.public, swarm=SWARM)
    assert reason(e) == "malformed"


# --- manifest schema -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "..", "", "a\\b", "x" * 129, "a b"])
def test_file_names_that_are_not_plain_are_refused(name: str) -> None:
    with pytest.raises(ValidationError):
        file_entry(name, b"abc", CHUNK)


def test_file_name_with_trailing_newline_is_refused() -> None:
    with pytest.raises(ValidationError):
        file_entry("model.safetensors\n", b"abc", CHUNK)


def test_chunk_sizes_must_add_up_to_the_file_size() -> None:
    entry, _ = file_entry("w.bin", b"0123456789", CHUNK)
    with pytest.raises(ValidationError, match="add up"):
        FileEntry(name="w.bin", size=11, sha256=entry.sha256, chunks=entry.chunks)
    with pytest.raises(ValidationError, match="add up"):
        FileEntry(name="w.bin", size=10, sha256=entry.sha256, chunks=entry.chunks[:-1])


def test_duplicate_file_names_are_refused() -> None:
    entry, _ = file_entry("w.bin", b"0123456789", CHUNK)
    with pytest.raises(ValidationError, match="duplicate"):
        Manifest(swarm=SWARM, version=1, created_ms=0, chunk_size=CHUNK, files=[entry, entry])


def test_chunk_larger_than_chunk_size_is_refused() -> None:
    entry, _ = file_entry("w.bin", b"0123456789", 8)
    with pytest.raises(ValidationError, match="larger than chunk_size"):
        Manifest(swarm=SWARM, version=1, created_ms=0, chunk_size=4, files=[entry])


def test_manifest_needs_a_file_and_a_positive_version() -> None:
    entry, _ = file_entry("w.bin", b"x", CHUNK)
    with pytest.raises(ValidationError):
        Manifest(swarm=SWARM, version=1, created_ms=0, chunk_size=CHUNK, files=[])
    with pytest.raises(ValidationError):
        Manifest(swarm=SWARM, version=0, created_ms=0, chunk_size=CHUNK, files=[entry])


def test_chunk_refs_deduplicates_identical_chunks() -> None:
    # "abcd" appears twice in a.bin and once in b.bin: one ref, fetched once.
    a, a_chunks = file_entry("a.bin", b"abcdabcdxy", CHUNK)
    b, _ = file_entry("b.bin", b"abcdzz", CHUNK)
    manifest = Manifest(swarm=SWARM, version=1, created_ms=0, chunk_size=CHUNK, files=[a, b])

    refs = manifest.chunk_refs()

    assert [r.sha256 for r in refs] == [sha256_hex(b"abcd"), sha256_hex(b"xy"), sha256_hex(b"zz")]
    assert refs[0] == ChunkRef(sha256=sha256_hex(b"abcd"), size=4)
    assert a_chunks == [b"abcd", b"abcd", b"xy"]


@pytest.mark.parametrize(
    ("size", "chunk_size", "expected"),
    [(10, 4, [4, 4, 2]), (8, 4, [4, 4]), (3, 4, [3]), (0, 4, []), (1, 1, [1])],
)
def test_split_chunks_sizes(size: int, chunk_size: int, expected: list[int]) -> None:
    data = bytes(range(size))
    chunks = list(split_chunks(data, chunk_size))
    assert [len(c) for c in chunks] == expected
    assert b"".join(chunks) == data


def test_file_entry_hashes() -> None:
    entry, chunks = file_entry("w.bin", b"0123456789", CHUNK)
    assert entry.size == 10
    assert entry.sha256 == sha256_hex(b"0123456789")
    assert [c.sha256 for c in entry.chunks] == [sha256_hex(c) for c in chunks]


def test_signed_manifest_bytes_are_canonical(key: PolicyKey) -> None:
    signed = SignedManifest.sign(make_manifest(), key)
    data = signed.to_bytes()
    assert SignedManifest.model_validate_json(data) == signed
    assert SignedManifest.model_validate_json(data).to_bytes() == data


# --- safetensors -----------------------------------------------------------------------------

def test_safetensors_tensors_reads_names_dtypes_shapes() -> None:
    data = save_safetensors(
        {"layer.weight": torch.zeros(2, 3), "layer.bias": torch.ones(3, dtype=torch.bfloat16),
         "step": torch.tensor(7, dtype=torch.int64)},
        metadata={"format": "pt"},
    )

    tensors = safetensors_tensors("model.safetensors", data)

    assert [(t.name, t.dtype, t.shape) for t in tensors] == [
        ("layer.bias", "BF16", [3]), ("layer.weight", "F32", [2, 3]), ("step", "I64", []),
    ]
    assert {t.file for t in tensors} == {"model.safetensors"}
    # Only the prefix and the JSON header are needed, not the tensor data.
    header_len = int.from_bytes(data[:8], "little")
    assert safetensors_tensors("model.safetensors", data[:8 + header_len]) == tensors


def test_safetensors_header_longer_than_the_data_is_refused() -> None:
    data = save_safetensors({"w": torch.zeros(2)})
    header_len = int.from_bytes(data[:8], "little")
    with pytest.raises(ValueError, match="header length"):
        safetensors_tensors("w.safetensors", data[:8 + header_len - 1])
    with pytest.raises(ValueError, match="header length"):
        safetensors_tensors("w.safetensors", (1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="too short"):
        safetensors_tensors("w.safetensors", b"\x00" * 7)
