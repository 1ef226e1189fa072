"""`publish.chunk_size = "auto"` (the default): about 256 chunks per version, a power of two within
64 KiB .. 8 MiB, so small models pipeline down the broadcast chains and large ones keep manifests small."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from echo2swarm.config.models import (
    AUTO_CHUNK_MAX,
    AUTO_CHUNK_MIN,
    AUTO_CHUNKS,
    FetchConfig,
    PublishConfig,
    auto_chunk_size,
)
from echo2swarm.learner.versions import VersionWriter
from echo2swarm.policy.manifest import MAX_CHUNKS, ChunkRef, FileEntry, Manifest, SignedManifest, verify_manifest
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.wire.signing import PolicyKey

PEER_ID = "12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"
GB = 10**9


@pytest.mark.parametrize("total", [0, 1, 64 * 1024, 10**6, 34 * 2**20, 40 * 10**6, GB, 2**30, 16 * GB, 10**13])
def test_auto_is_a_power_of_two_within_its_bounds_and_near_256_chunks(total: int):
    size = auto_chunk_size(total)
    assert AUTO_CHUNK_MIN <= size <= AUTO_CHUNK_MAX and size & (size - 1) == 0
    if AUTO_CHUNK_MIN < size < AUTO_CHUNK_MAX:  # not clamped: between 256 and 512 chunks
        assert AUTO_CHUNKS <= -(-total // size) < 2 * AUTO_CHUNKS


def test_auto_grows_with_the_model():
    sizes = [auto_chunk_size(2**k) for k in range(10, 45)]
    assert sizes == sorted(sizes)
    assert auto_chunk_size(40 * 10**6) == 128 * 1024  # the lab's 34-40 MB models
    assert auto_chunk_size(2**30) == 4 * 2**20 and auto_chunk_size(16 * GB) == 8 * 2**20


def test_a_16_gb_model_s_manifest_stays_small():
    """16 GB at auto: 8 MiB chunks, ~1900 of them, a signed manifest of ~0.2 MB: far under every bound."""
    size = auto_chunk_size(16 * GB)
    files, left, n = [], 16 * GB, 0
    while left > 0:  # 4 safetensors shards of 4 GB, each cut in `size` slices, every chunk distinct
        shard = min(4 * GB, left)
        refs = [ChunkRef(sha256=hashlib.sha256(f"{n}.{i}".encode()).hexdigest(), size=min(size, shard - i * size))
                for i in range(-(-shard // size))]
        files.append(FileEntry(name=f"model-{n:05d}.safetensors", size=shard, sha256="0" * 64, chunks=refs))
        left, n = left - shard, n + 1
    manifest = Manifest(swarm="s", version=1, created_ms=1, chunk_size=size, files=files)
    chunks = sum(len(f.chunks) for f in files)
    data = SignedManifest.sign(manifest, PolicyKey.generate()).to_bytes()
    assert 1900 <= chunks <= 1910 and chunks <= MAX_CHUNKS
    assert len(data) < 256 * 1024 < FetchConfig().max_manifest_bytes
    assert size <= FetchConfig().max_chunk_bytes


def test_the_config_takes_auto_by_default_or_a_size():
    assert PublishConfig().chunk_size == "auto"
    assert PublishConfig(chunk_size="1MiB").chunk_size == 2**20
    assert PublishConfig(delta_chunk_size="1MiB").delta_chunk_size == 2**20  # auto: clamped when published
    with pytest.raises(ValidationError, match="delta_chunk_size"):
        PublishConfig(chunk_size="64KiB", delta_chunk_size="1MiB")
    with pytest.raises(ValidationError, match="chunk_size"):
        PublishConfig(chunk_size="automatic")


def test_the_publisher_sizes_each_version_with_auto(tmp_path: Path):
    key = PolicyKey.generate()
    chunks, versions = ChunkStore(tmp_path / "chunks"), VersionStore(tmp_path / "versions")
    writer = VersionWriter("s", key, chunks, versions, "auto", PEER_ID, delta_chunk_size=2**20)
    weights = bytes(range(256)) * (4 * 2**20 // 256 * 10)  # 40 MiB: 128 KiB chunks
    published = writer.write_files({"weights.bin": weights, "config.json": b"{}"}, version=1)
    data = versions.manifest_bytes(1)
    assert data is not None
    manifest = verify_manifest(data, writer.sign_head(published, ttl_s=30), trusted=key.public, swarm="s")
    assert manifest.chunk_size == 128 * 1024 == writer.chunk_size
    assert writer.delta_chunk_size == 128 * 1024  # a delta is cut no coarser than the version's chunks
    assert [len(f.chunks) for f in manifest.files] == [1, 320]
    small = VersionWriter("s", key, chunks, versions, "auto", PEER_ID)
    small.write_files({"weights.bin": b"x" * 10**6}, version=2)
    assert small.chunk_size == AUTO_CHUNK_MIN

