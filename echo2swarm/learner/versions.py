"""Turn a model directory into signed policy version v: chunks in the store, a signed manifest, a head.

Only safetensors weights and plain config/tokenizer files are published: never pickled weights
or Python files, which would run code on every rollout peer that loads them.

Trained weights (`publish_state`) go out as a keyframe (dense) or a delta against the previous
version (policy/delta.py), whichever `keyframe_due` says:

    v1 dense ─► v2 Δ(v1) ─► v3 Δ(v2) + composite Δ(v1) ─► ... ─► v11 dense + Δ(v10) ─► v12 Δ(v11) ...

A delta version's manifest names its base and keyframe by manifest sha256 and carries every
resulting tensor's sha256; a keyframe also offers the delta from the previous version, so a peer
that follows every version never downloads a dense copy after it joined. The learner's own
version directory always holds the dense weights (the verifier and rollback read them).
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from echo2swarm.config.models import auto_chunk_size
from echo2swarm.policy.manifest import (
    SAFETENSORS_MAX_HEADER,
    BaseRef,
    ChunkRef,
    DeltaFile,
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

if TYPE_CHECKING:  # torch only where weights are encoded: importing this module stays light
    import torch

logger = get_logger(__name__)
PUBLISHED_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt", ".model", ".tiktoken")
WEIGHTS_FILE = "model.safetensors"


def delta_file_name(base: int) -> str:
    return f"delta-from-v{base:08d}.e2sd"


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
    """A version in the learner's stores, ready to be announced by a signed head.

    `kind` is "dense" (a keyframe) or "delta"; `delta_bytes` the delta from the previous version
    (offered by keyframes too), `composite_bytes` the composite from the keyframe (None: none)."""

    version: int
    manifest_sha256: str
    manifest_size: int
    kind: str = "dense"
    dense_bytes: int = 0
    delta_bytes: int | None = None
    composite_bytes: int | None = None
    keyframe_reason: str | None = None

    def report(self) -> dict[str, object]:
        ratio = None if not self.delta_bytes else round(self.dense_bytes / self.delta_bytes, 2)
        return {"kind": self.kind, "dense_bytes": self.dense_bytes, "delta_bytes": self.delta_bytes,
                "composite_bytes": self.composite_bytes, "ratio": ratio, "keyframe_reason": self.keyframe_reason}


@dataclass
class DeltaBase:
    """A published version's tensors (in the publish dtype), kept to encode the next deltas against."""

    version: int
    manifest_sha256: str
    tensors: "dict[str, torch.Tensor]" = field(repr=False)


def keyframe_due(version: int, keyframe: int | None, delta_bytes: int | None, dense_bytes: int,
                 keyframe_every: int, max_ratio: float) -> str | None:
    """Why `version` must be dense (a keyframe), or None: publish it as a delta.

    "first": no base to delta against; "interval": `keyframe_every` versions since the last
    keyframe; "ratio": the delta is not at most `max_ratio` of the dense weights.
    """
    if keyframe is None or delta_bytes is None:
        return "first"
    if version - keyframe >= keyframe_every:
        return "interval"
    if delta_bytes > max_ratio * dense_bytes:
        return "ratio"
    return None


class VersionWriter:
    """Build and sign versions into the learner's own stores, which its chunk server serves.

    >>> writer = VersionWriter("demo", PolicyKey.load(key_path), chunks, versions, 8 << 20, peer_id)
    >>> published = writer.write_dir(Path("tiny"), version=1)
    >>> head = writer.sign_head(published, ttl_s=30)           # re-signed at every announcement
    """

    def __init__(
        self, swarm: str, key: PolicyKey, chunks: ChunkStore, versions: VersionStore,
        chunk_size: int | Literal["auto"], peer_id: str, delta_chunk_size: int | None = None,
    ):
        self.swarm = swarm
        self.key = key
        self.chunks = chunks
        self.versions = versions
        self.chunk_setting = chunk_size  # "auto": sized to each version (`auto_chunk_size`) when it is published
        self.delta_setting = delta_chunk_size
        self._sized(0)
        self.peer_id = peer_id

    def _sized(self, total_bytes: int) -> None:
        """Set this version's chunk size (`auto`: from its `total_bytes`) and its delta chunk size."""
        setting = self.chunk_setting
        self.chunk_size = setting if isinstance(setting, int) else auto_chunk_size(total_bytes)
        # delta files in finer chunks (publish.delta_chunk_size), so they pipeline down the chains
        self.delta_chunk_size = min(self.delta_setting or self.chunk_size, self.chunk_size)

    def _add_file(self, name: str, source: Path | bytes, chunk_size: int | None = None) -> FileEntry:
        digest, refs, size = hashlib.sha256(), [], 0
        with (open(source, "rb") if isinstance(source, Path) else io.BytesIO(source)) as f:
            while piece := f.read(chunk_size or self.chunk_size):
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

    def write_dir(self, model_dir: Path, version: int) -> PublishedVersion:
        return self.write_files({p.name: p for p in model_files(model_dir)}, version)

    def write_files(self, files: dict[str, Path | bytes], version: int) -> PublishedVersion:
        """Publish named files (paths, or bytes such as freshly trained safetensors weights) as `version`."""
        started = time.monotonic()
        names = sorted(files)
        self._sized(sum(f.stat().st_size if isinstance(f, Path) else len(f) for f in files.values()))
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

    def write_state(
        self, state: "dict[str, torch.Tensor]", extras: dict[str, Path | bytes], version: int, *,
        previous: DeltaBase | None, keyframe: DeltaBase | None, keyframe_every: int, max_ratio: float,
        chain_bytes: int = 0, composites: bool = True,
    ) -> PublishedVersion:
        """Publish trained tensors (in the publish dtype) as `version`: a keyframe or a delta.

        `previous` is the last published version, `keyframe` the last dense one, `chain_bytes` the
        sum of the deltas published since it (a composite from the keyframe is offered only when
        it is smaller than that chain). Returns what was published, with its byte counts.
        """
        from safetensors.torch import save as save_safetensors

        from echo2swarm.policy.delta import encode_delta, tensor_sha256

        started = time.monotonic()
        dense = save_safetensors(state, metadata={"format": "pt"})
        self._sized(len(dense) + sum(f.stat().st_size if isinstance(f, Path) else len(f)
                                     for name, f in extras.items() if name != WEIGHTS_FILE))
        primary = encode_delta(previous.tensors, state) if previous is not None else None
        reason = keyframe_due(version, keyframe.version if keyframe else None,
                              None if primary is None else len(primary), len(dense), keyframe_every, max_ratio)
        header = self._tensors(WEIGHTS_FILE, dense)
        tensors = [t.model_copy(update={"sha256": tensor_sha256(state[t.name])}) for t in header]
        names = sorted(extras)
        entries = [self._add_file(name, extras[name]) for name in names if name != WEIGHTS_FILE]
        deltas: list[DeltaFile] = []
        # keyframe_every = 1 means every version dense on the wire too: no delta to offer beside it
        if primary is not None and previous is not None and len(primary) < len(dense) and keyframe_every > 1:
            deltas.append(DeltaFile(base=BaseRef(version=previous.version, manifest_sha256=previous.manifest_sha256),
                                    file=self._add_file(delta_file_name(previous.version), primary,
                                                        self.delta_chunk_size)))
        composite = None
        if composites and reason is None and keyframe is not None and previous is not None \
                and keyframe.version != previous.version:
            blob = encode_delta(keyframe.tensors, state)
            if len(blob) < chain_bytes + len(primary or b""):
                composite = len(blob)
                deltas.append(DeltaFile(base=BaseRef(version=keyframe.version, manifest_sha256=keyframe.manifest_sha256),
                                        file=self._add_file(delta_file_name(keyframe.version), blob,
                                                            self.delta_chunk_size)))
        if reason is not None:  # dense: the weights are a file of the version; deltas are alternatives
            entries = sorted(entries + [self._add_file(WEIGHTS_FILE, dense)], key=lambda e: e.name)
            manifest = Manifest(swarm=self.swarm, version=version, created_ms=int(time.time() * 1000),
                                chunk_size=self.chunk_size, files=entries, tensors=tensors, alternatives=deltas)
        else:
            assert keyframe is not None
            manifest = Manifest(swarm=self.swarm, version=version, created_ms=int(time.time() * 1000),
                                chunk_size=self.chunk_size, files=entries, tensors=tensors,
                                delta=deltas[0], alternatives=deltas[1:],
                                keyframe=BaseRef(version=keyframe.version, manifest_sha256=keyframe.manifest_sha256))
        envelope = SignedManifest.sign(manifest, self.key).to_bytes()
        self.versions.install(manifest, envelope, self.chunks,
                              extra=None if manifest.delta is None else {WEIGHTS_FILE: dense})
        published = PublishedVersion(
            version, sha256_hex(envelope), len(envelope), kind="dense" if reason else "delta", dense_bytes=len(dense),
            delta_bytes=None if primary is None else len(primary), composite_bytes=composite, keyframe_reason=reason,
        )
        logger.debug("published policy v%d (%s%s): dense %d bytes, delta %s, composite %s (%.2f s)", version,
                     published.kind, f", {reason}" if reason else "", len(dense), published.delta_bytes, composite,
                     time.monotonic() - started)
        return published

    def sign_head(
        self, published: PublishedVersion, ttl_s: float, chunk_url: str | None = None, maddrs: list[str] | None = None,
        card_shard_bits: int = 0, verifiers: list[str] | None = None,
    ) -> HeadRecord:
        """A fresh head whose signed expiry bounds how long any node keeps it (replays die with it).

        It carries where followers reach us (chunk URL, multiaddrs), so no forged card can send
        followers elsewhere, the swarm's card shard depth (overlay/dht_keys.py) and the verifier
        daemons we send exact checks to (learner/verifiers.py).
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
            verifiers=list(verifiers or []),
            card_shard_bits=card_shard_bits,
        ).signed(self.key)
