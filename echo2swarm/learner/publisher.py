"""Turn a model directory into signed policy version v: chunks in the store, a signed manifest, a head.

Only safetensors weights and plain config/tokenizer files are published: never pickled weights
or Python files, which would run code on every rollout peer that loads them.
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass
from pathlib import Path

from echo2swarm.policy.manifest import (
    SAFETENSORS_MAX_HEADER,
    ChunkRef,
    FileEntry,
    Manifest,
    SignedManifest,
    TensorInfo,
    safetensors_tensors,
    sha256_hex,
)
from echo2swarm.wire.records import HeadRecord
from echo2swarm.wire.signing import PolicyKey
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
PUBLISHED_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt", ".model", ".tiktoken")


class ModelDirError(ValueError):
    pass


def model_files(model_dir: Path) -> list[Path]:
    """The files of a Hugging Face model directory that make up a version, sorted by name."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelDirError(f"--model {model_dir}: not a directory (create one with `echo2swarm tiny-model DIR`)")
    files = sorted(
        p for p in model_dir.iterdir()
        if p.is_file() and p.suffix in PUBLISHED_SUFFIXES and not p.name.startswith(".")
    )
    if not any(p.suffix == ".safetensors" for p in files):
        raise ModelDirError(f"--model {model_dir}: no *.safetensors weights (pickled .bin weights are not published)")
    if not (model_dir / "config.json").is_file():
        raise ModelDirError(f"--model {model_dir}: no config.json; is this a Hugging Face model directory?")
    return files


@dataclass(frozen=True)
class PublishedVersion:
    """A version in the learner's stores, ready to be announced by a signed head."""

    version: int
    manifest_sha256: str
    manifest_size: int


class Publisher:
    """Build and sign versions into the learner's own stores, which its chunk server serves.

    >>> publisher = Publisher("demo", PolicyKey.load(key_path), chunks, versions, 8 << 20, peer_id)
    >>> published = publisher.publish_dir(Path("tiny"), version=1)
    >>> head = publisher.sign_head(published, ttl_s=30)           # re-signed at every announcement
    """

    def __init__(
        self, swarm: str, key: PolicyKey, chunks: ChunkStore, versions: VersionStore, chunk_size: int, peer_id: str
    ):
        self.swarm = swarm
        self.key = key
        self.chunks = chunks
        self.versions = versions
        self.chunk_size = chunk_size
        self.peer_id = peer_id

    def _add_file(self, name: str, source: Path | bytes) -> FileEntry:
        digest, refs, size = hashlib.sha256(), [], 0
        with (open(source, "rb") if isinstance(source, Path) else io.BytesIO(source)) as f:
            while piece := f.read(self.chunk_size):
                sha = sha256_hex(piece)
                self.chunks.put(sha, piece)
                refs.append(ChunkRef(sha256=sha, size=len(piece)))
                digest.update(piece)
                size += len(piece)
        return FileEntry(name=name, size=size, sha256=digest.hexdigest(), chunks=refs)

    @staticmethod
    def _tensors(name: str, source: Path | bytes) -> list[TensorInfo]:
        with (open(source, "rb") if isinstance(source, Path) else io.BytesIO(source)) as f:
            prefix = f.read(8)
            header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
            return safetensors_tensors(name, prefix + f.read(min(header_len, SAFETENSORS_MAX_HEADER)))

    def publish_dir(self, model_dir: Path, version: int) -> PublishedVersion:
        return self.publish_files({p.name: p for p in model_files(model_dir)}, version)

    def publish_files(self, files: dict[str, Path | bytes], version: int) -> PublishedVersion:
        """Publish named files (paths, or bytes such as freshly trained safetensors weights) as `version`."""
        started = time.monotonic()
        names = sorted(files)
        entries = [self._add_file(name, files[name]) for name in names]
        tensors = [t for name in names if name.endswith(".safetensors") for t in self._tensors(name, files[name])]
        manifest = Manifest(
            swarm=self.swarm,
            version=version,
            created_ms=int(time.time() * 1000),
            chunk_size=self.chunk_size,
            files=entries,
            tensors=tensors,
        )
        envelope = SignedManifest.sign(manifest, self.key).to_bytes()
        self.versions.install(manifest, envelope, self.chunks)
        logger.debug(
            "published policy v%d: %d files, %d bytes in %d chunks, signed by %s (%.2f s)",
            version, len(entries), manifest.total_bytes, sum(len(e.chunks) for e in entries),
            self.key.public.fingerprint, time.monotonic() - started,
        )
        return PublishedVersion(version, sha256_hex(envelope), len(envelope))

    def sign_head(
        self, published: PublishedVersion, ttl_s: float, chunk_url: str | None = None, maddrs: list[str] | None = None
    ) -> HeadRecord:
        """A fresh head whose signed expiry bounds how long any node keeps it (replays die with it).

        It carries where followers reach us (chunk URL, multiaddrs), so no forged card can send
        followers elsewhere.
        """
        now_ms = int(time.time() * 1000)
        return HeadRecord(
            swarm=self.swarm,
            version=published.version,
            manifest_sha256=published.manifest_sha256,
            manifest_size=published.manifest_size,
            publisher=self.peer_id,
            published_ms=now_ms,
            expires_ms=now_ms + int(ttl_s * 1000),
            public_key=self.key.public.text,
            chunk_url=chunk_url,
            maddrs=list(maddrs or [])[:8],
        ).signed(self.key)
