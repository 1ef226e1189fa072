"""Manifests: the signed description of one policy version, and how a head record pointing at it is checked.

A version is a set of files (weights as safetensors, config, tokenizer), each cut into fixed-size,
content-addressed chunks. A *dense* version (a keyframe) lists its weights file among `files`; a
*delta* version lists only the non-weight files and carries `delta`: a file (chunked like any other)
that rebuilds the weights from a named base version (policy/delta.py), plus `alternatives` (deltas
from other bases: composites for catch-up) and the latest `keyframe`. Either way every TensorInfo
carries the sha256 of the resulting tensor's raw bytes, which a follower checks after rebuilding and
before it installs or re-serves anything (docs/protocol.md, "Delta versions"). The manifest lists every file's chunks with sha256 and size; the signed
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
from echo2swarm.runtime.safetensors import MAX_HEADER

MANIFEST_FORMAT = "echo2swarm-manifest/1"
# Plain file names only: a manifest can never make a follower write outside its version directory.
_FILE_NAME = re.compile(r"^(?!\.)[A-Za-z0-9._-]{1,128}$")
MAX_FILES = 256
MAX_CHUNKS = 1 << 20
MAX_TENSORS = 1 << 16
MAX_CHUNK_SIZE = 64 * 1024 * 1024
MAX_ALTERNATIVES = 8  # deltas from other bases one manifest may offer (composites)
SAFETENSORS_MAX_HEADER = MAX_HEADER  # runtime/safetensors.py


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
    # sha256 of the resulting tensor's raw bytes (delta.tensor_sha256); required in delta manifests
    sha256: Sha256 | None = None


class BaseRef(_Strict):
    """A version named by its number and the sha256 of its signed manifest envelope (hash-linked)."""

    version: int = Field(ge=1, le=MAX_VERSION)
    manifest_sha256: Sha256


class DeltaFile(_Strict):
    """A delta (policy/delta.py's format) that rebuilds this version's weights from `base`."""

    base: BaseRef
    file: FileEntry


class Manifest(_Strict):
    format: Literal["echo2swarm-manifest/1"] = MANIFEST_FORMAT
    swarm: str = Field(max_length=64)
    version: int = Field(ge=1, le=MAX_VERSION)
    created_ms: int = Field(ge=0)
    chunk_size: int = Field(gt=0, le=MAX_CHUNK_SIZE)
    files: list[FileEntry] = Field(min_length=1, max_length=MAX_FILES)
    tensors: list[TensorInfo] = Field(default_factory=list, max_length=MAX_TENSORS)
    # Delta versions only: the weights are rebuilt from `delta.base` (or an alternative's base).
    delta: DeltaFile | None = None
    # Other ways to rebuild the same weights: deltas from other bases (any version may offer them).
    alternatives: list[DeltaFile] = Field(default_factory=list, max_length=MAX_ALTERNATIVES)
    # The latest dense version at or before this one (delta versions: where a new joiner starts).
    keyframe: BaseRef | None = None

    def model_post_init(self, _context: object) -> None:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("duplicate file names")
        for f in self.files + [d.file for d in self.deltas()]:
            if any(c.size > self.chunk_size for c in f.chunks):
                raise ValueError(f"file {f.name}: a chunk is larger than chunk_size")
        weight_files = {t.file for t in self.tensors}
        if self.delta is None:
            if weight_files - set(names):
                raise ValueError("a tensor names a file the manifest does not list")
            if self.keyframe is not None:
                raise ValueError("a dense version is its own keyframe: keyframe must be unset")
        else:
            if not self.tensors or weight_files & set(names):
                raise ValueError("a delta version lists its tensors and not their (rebuilt) weights file")
            if self.keyframe is None or self.keyframe.version >= self.version:
                raise ValueError("a delta version names an older keyframe")
        if self.deltas():
            if len(weight_files) != 1 or any(t.sha256 is None for t in self.tensors):
                raise ValueError("deltas rebuild one weights file whose every tensor carries its sha256")
            _check_name(next(iter(weight_files)))
            delta_names = [d.file.name for d in self.deltas()]
            if set(delta_names) & (set(names) | weight_files) or len(set(delta_names)) != len(delta_names):
                raise ValueError("delta file names must differ from each other and from the version's files")
            bases = [d.base.version for d in self.deltas()]
            if len(set(bases)) != len(bases) or max(bases) >= self.version:
                raise ValueError("each delta has its own base, older than the version")

    def deltas(self) -> list[DeltaFile]:
        """Every delta this manifest offers: the primary one first, then the alternatives."""
        return ([self.delta] if self.delta is not None else []) + list(self.alternatives)

    @property
    def weights_file(self) -> str | None:
        """The weights file the tensors live in (rebuilt from a delta, or listed in `files`)."""
        return self.tensors[0].file if self.tensors and len({t.file for t in self.tensors}) == 1 else None

    @property
    def total_bytes(self) -> int:
        """Bytes a follower fetches on the version's default path (dense files, or non-weight files + delta)."""
        return sum(f.size for f in self.files) + (self.delta.file.size if self.delta else 0)

    @property
    def dense_bytes(self) -> int:
        """Size of the (rebuilt) weights: what a dense copy of this version's weights costs."""
        listed = {f.name: f.size for f in self.files}
        if self.delta is None:
            return sum(listed[f] for f in {t.file for t in self.tensors}) if self.tensors else self.total_bytes
        return sum(_tensor_bytes(t) for t in self.tensors)

    def path_files(self, delta: DeltaFile | None) -> list[FileEntry]:
        """The files to fetch to install this version through `delta` (None: densely)."""
        if delta is None:
            if self.delta is not None:
                raise ValueError(f"v{self.version} is a delta version: it has no dense path")
            return list(self.files)
        weight_files = {t.file for t in self.tensors}
        return [f for f in self.files if f.name not in weight_files] + [delta.file]

    def chunk_refs(self, files: list[FileEntry] | None = None) -> list[ChunkRef]:
        """Every distinct chunk once, in file order (identical chunks are fetched once): of `files`,
        or of the default path (dense files, or non-weight files then the primary delta)."""
        seen: dict[str, ChunkRef] = {}
        for f in files if files is not None else self.files + ([self.delta.file] if self.delta else []):
            for c in f.chunks:
                seen.setdefault(c.sha256, c)
        return list(seen.values())

    def all_chunk_refs(self) -> list[ChunkRef]:
        """Every chunk any path of this version uses (what a store keeps for it)."""
        return self.chunk_refs(self.files + [d.file for d in self.deltas()])


_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _tensor_bytes(t: TensorInfo) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n * _ITEMSIZE.get(t.dtype, 0)


def _check_name(name: str) -> None:
    if not _FILE_NAME.fullmatch(name):
        raise ValueError(f"file name {name!r} is not a plain file name")


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
    return _verify_envelope(data, head.version, trusted=trusted, swarm=swarm, max_chunk_bytes=max_chunk_bytes)


def _verify_envelope(data: bytes, version: int, *, trusted: PublicKey, swarm: str, max_chunk_bytes: int) -> Manifest:
    try:
        envelope = SignedManifest.model_validate(json.loads(data))
    except (ValueError, ValidationError) as e:
        raise ManifestError("malformed", f"manifest v{version} is malformed: {str(e)[:200]}") from None
    if envelope.public_key != trusted.text:
        raise ManifestError("untrusted_key", "manifest signed by another key than the pinned learner key")
    message = canonical_bytes(envelope.manifest.model_dump(mode="json"))
    if not trusted.verify(DOMAIN_MANIFEST, message, bytes.fromhex(envelope.signature)):
        raise ManifestError("bad_signature", f"manifest v{version} has a bad signature")
    manifest = envelope.manifest
    if manifest.swarm != swarm:
        raise ManifestError("wrong_swarm", f"manifest is for swarm {manifest.swarm!r}, we are in {swarm!r}")
    if manifest.version != version:
        raise ManifestError("version_mismatch", f"manifest says v{manifest.version}, its link says v{version}")
    if manifest.chunk_size > max_chunk_bytes:
        raise ManifestError(
            "too_large", f"manifest chunks of {manifest.chunk_size} bytes exceed our limit of {max_chunk_bytes} (fetch.max_chunk_bytes)"
        )
    return manifest


def verify_linked_manifest(
    data: bytes, ref: BaseRef, *, trusted: PublicKey, swarm: str, max_chunk_bytes: int = MAX_CHUNK_SIZE
) -> Manifest:
    """Check an older version's manifest reached through a hash link (a delta's base, a keyframe)
    from a verified manifest: its bytes must hash to `ref.manifest_sha256`, and it must be signed
    by the pinned key like any other."""
    if sha256_hex(data) != ref.manifest_sha256:
        raise ManifestError("hash_mismatch", f"manifest v{ref.version} bytes do not match the linking manifest's sha256")
    return _verify_envelope(data, ref.version, trusted=trusted, swarm=swarm, max_chunk_bytes=max_chunk_bytes)


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
