"""Manifests: the signed description of one policy version, and how a head record pointing at it is checked.

A version is a set of files (weights as safetensors, config, tokenizer), each cut into fixed-size,
content-addressed chunks. The manifest lists every file's chunks with sha256 and size; the signed
envelope carries the manifest, the signer's public key and an Ed25519 signature over the
manifest's canonical bytes. The head record, small enough for the DHT, names the newest version
and the sha256 of its envelope, and is signed on its own (its schema is in wire/records.py).

Everything here is pure: parsing and verification never touch the network or the disk.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from echo2swarm.wire.records import MAX_VERSION, HeadRecord, RecordError, Sha256
from echo2swarm.wire.signing import DOMAIN_MANIFEST, PolicyKey, PublicKey, canonical_bytes

MANIFEST_FORMAT = "echo2swarm-manifest/1"
# Plain file names only: a manifest can never make a follower write outside its version directory.
_FILE_NAME = re.compile(r"^(?!\.)[A-Za-z0-9._-]{1,128}$")
MAX_FILES = 256
MAX_CHUNKS = 1 << 20
MAX_TENSORS = 1 << 16
MAX_CHUNK_SIZE = 64 * 1024 * 1024
SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024


class ManifestError(RecordError):
    """A manifest or head that must not be used. `reason` is a short counter label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message, reason)


class _Strict(BaseModel):
    # strict: "5" or 5.0 is not the int 5, so each signed object has exactly one wire form.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ChunkRef(_Strict):
    sha256: Sha256
    size: int = Field(gt=0)


class FileEntry(_Strict):
    name: str
    size: int = Field(ge=0)
    sha256: Sha256
    chunks: list[ChunkRef] = Field(max_length=MAX_CHUNKS)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _FILE_NAME.fullmatch(v):
            raise ValueError(f"file name {v!r} is not a plain file name")
        return v

    def model_post_init(self, _context: object) -> None:
        if sum(c.size for c in self.chunks) != self.size:
            raise ValueError(f"file {self.name}: chunk sizes do not add up to the file size")


class TensorInfo(_Strict):
    name: str = Field(max_length=512)
    dtype: str = Field(max_length=16)
    shape: list[Annotated[int, Field(ge=0)]] = Field(max_length=16)
    file: str = Field(max_length=128)


class Manifest(_Strict):
    format: Literal["echo2swarm-manifest/1"] = MANIFEST_FORMAT
    swarm: str = Field(max_length=64)
    version: int = Field(ge=1, le=MAX_VERSION)
    created_ms: int = Field(ge=0)
    chunk_size: int = Field(gt=0, le=MAX_CHUNK_SIZE)
    files: list[FileEntry] = Field(min_length=1, max_length=MAX_FILES)
    tensors: list[TensorInfo] = Field(default_factory=list, max_length=MAX_TENSORS)

    def model_post_init(self, _context: object) -> None:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("duplicate file names")
        if any(t.file not in names for t in self.tensors):
            raise ValueError("a tensor names a file the manifest does not list")
        for f in self.files:
            if any(c.size > self.chunk_size for c in f.chunks):
                raise ValueError(f"file {f.name}: a chunk is larger than chunk_size")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def chunk_refs(self) -> list[ChunkRef]:
        """Every distinct chunk once, in file order (identical chunks are fetched once)."""
        seen: dict[str, ChunkRef] = {}
        for f in self.files:
            for c in f.chunks:
                seen.setdefault(c.sha256, c)
        return list(seen.values())


class SignedManifest(_Strict):
    manifest: Manifest
    public_key: str
    signature: str = Field(pattern=r"^[0-9a-f]{128}$")

    @classmethod
    def sign(cls, manifest: Manifest, key: PolicyKey) -> "SignedManifest":
        sig = key.sign(DOMAIN_MANIFEST, canonical_bytes(manifest.model_dump(mode="json")))
        return cls(manifest=manifest, public_key=key.public.text, signature=sig.hex())

    def to_bytes(self) -> bytes:
        return canonical_bytes(self.model_dump(mode="json"))


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verify_head(head: HeadRecord, *, trusted: PublicKey | None, swarm: str, held_version: int | None) -> None:
    """Raise ManifestError unless `head` is a correctly signed, newer version of our swarm."""
    if head.swarm != swarm:
        raise ManifestError("wrong_swarm", f"head is for swarm {head.swarm!r}, we are in {swarm!r}")
    if trusted is not None and head.public_key != trusted.text:
        raise ManifestError("untrusted_key", f"head signed by {head.public_key[:24]}..., not the pinned learner key")
    if not head.signature_ok():
        raise ManifestError("bad_signature", f"head v{head.version} has a bad signature")
    if held_version is not None and head.version <= held_version:
        raise ManifestError("stale_version", f"head v{head.version} is not newer than held v{held_version}")


def verify_manifest(
    data: bytes, head: HeadRecord, *, trusted: PublicKey, swarm: str, max_chunk_bytes: int = MAX_CHUNK_SIZE
) -> Manifest:
    """Check a fetched manifest envelope against the (already verified) head and the pinned key."""
    if sha256_hex(data) != head.manifest_sha256:
        raise ManifestError("hash_mismatch", f"manifest v{head.version} bytes do not match the head's sha256")
    try:
        envelope = SignedManifest.model_validate(json.loads(data))
    except (ValueError, ValidationError) as e:
        raise ManifestError("malformed", f"manifest v{head.version} is malformed: {str(e)[:200]}") from None
    if envelope.public_key != trusted.text:
        raise ManifestError("untrusted_key", "manifest signed by another key than the pinned learner key")
    message = canonical_bytes(envelope.manifest.model_dump(mode="json"))
    if not trusted.verify(DOMAIN_MANIFEST, message, bytes.fromhex(envelope.signature)):
        raise ManifestError("bad_signature", f"manifest v{head.version} has a bad signature")
    manifest = envelope.manifest
    if manifest.swarm != swarm:
        raise ManifestError("wrong_swarm", f"manifest is for swarm {manifest.swarm!r}, we are in {swarm!r}")
    if manifest.version != head.version:
        raise ManifestError("version_mismatch", f"manifest says v{manifest.version}, head says v{head.version}")
    if manifest.chunk_size > max_chunk_bytes:
        raise ManifestError(
            "too_large", f"manifest chunks of {manifest.chunk_size} bytes exceed our limit of {max_chunk_bytes} (fetch.max_chunk_bytes)"
        )
    return manifest


def split_chunks(data: bytes, chunk_size: int) -> Iterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), chunk_size):
        yield bytes(view[start:start + chunk_size])


def file_entry(name: str, data: bytes, chunk_size: int) -> tuple[FileEntry, list[bytes]]:
    """Cut one file into chunks; returns its manifest entry and the chunk bytes in order."""
    chunks = list(split_chunks(data, chunk_size))
    entry = FileEntry(
        name=name,
        size=len(data),
        sha256=sha256_hex(data),
        chunks=[ChunkRef(sha256=sha256_hex(c), size=len(c)) for c in chunks],
    )
    return entry, chunks


def safetensors_tensors(name: str, head: bytes) -> list[TensorInfo]:
    """Tensor names, dtypes and shapes from a safetensors file's first bytes (bounded, no torch needed).

    `head` must hold at least the 8-byte length prefix and the JSON header that follows it.
    """
    if len(head) < 8:
        raise ValueError(f"{name} is too short to be safetensors")
    header_len = int.from_bytes(head[:8], "little")
    if header_len > min(len(head) - 8, SAFETENSORS_MAX_HEADER):
        raise ValueError(f"{name} has an impossible safetensors header length")
    header = json.loads(head[8:8 + header_len])
    return [
        TensorInfo(name=k, dtype=v["dtype"], shape=list(v["shape"]), file=name)
        for k, v in sorted(header.items())
        if k != "__metadata__"
    ]
