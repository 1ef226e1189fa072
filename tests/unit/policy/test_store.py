"""Content-addressed chunk store and atomic version installs (echo2swarm/policy/store.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo2swarm.policy.manifest import Manifest, SignedManifest, file_entry, sha256_hex
from echo2swarm.wire.signing import PolicyKey
from echo2swarm.policy.store import (
    ChunkHashError,
    ChunkStore,
    VersionStore,
    collect_garbage,
)

CHUNK = 4
FILES = {"model.safetensors": b"0123456789abcdef0123", "config.json": b'{"a": 1}', "empty.txt": b""}


@pytest.fixture(scope="module")
def key() -> PolicyKey:
    return PolicyKey.generate()


@pytest.fixture
def chunks(tmp_path: Path) -> ChunkStore:
    return ChunkStore(tmp_path)


@pytest.fixture
def versions(tmp_path: Path) -> VersionStore:
    return VersionStore(tmp_path)


def build(version: int, key: PolicyKey, files: dict[str, bytes] = FILES) -> tuple[Manifest, bytes, list[bytes]]:
    entries, all_chunks = [], []
    for name, data in files.items():
        entry, pieces = file_entry(name, data, CHUNK)
        entries.append(entry)
        all_chunks += pieces
    manifest = Manifest(swarm="demo", version=version, created_ms=0, chunk_size=CHUNK, files=entries)
    return manifest, SignedManifest.sign(manifest, key).to_bytes(), all_chunks


def put_all(store: ChunkStore, pieces: list[bytes]) -> None:
    for piece in pieces:
        store.put(sha256_hex(piece), piece)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


# --- chunks ----------------------------------------------------------------------------------

def test_put_and_get(chunks: ChunkStore) -> None:
    name = sha256_hex(b"hello")
    assert not chunks.has(name)
    chunks.put(name, b"hello")
    chunks.put(name, b"hello")  # idempotent
    assert chunks.has(name)
    assert chunks.get(name) == b"hello"
    assert chunks.path(name) == chunks.root / name[:2] / name


def test_put_refuses_bytes_not_matching_the_name(chunks: ChunkStore) -> None:
    name = sha256_hex(b"hello")
    with pytest.raises(ChunkHashError):
        chunks.put(name, b"hellO")
    assert not chunks.has(name)
    assert files_under(chunks.root) == []


@pytest.mark.parametrize("name", ["../../etc/passwd", "ab", "A" * 64, "g" * 64, "0" * 63, "0" * 65, "", "0" * 62 + "/x"])
def test_path_refuses_non_hex_names(chunks: ChunkStore, name: str) -> None:
    with pytest.raises(ValueError):
        chunks.path(name)


def test_put_refuses_traversal_name(chunks: ChunkStore) -> None:
    with pytest.raises(ValueError):
        chunks.put("../../etc/passwd", b"x")
    assert files_under(chunks.root.parent) == []


def test_remove_except_keeps_only_referenced_chunks(chunks: ChunkStore) -> None:
    keep, drop = [b"keep1", b"keep2"], [b"drop1", b"drop2", b"drop3"]
    put_all(chunks, keep + drop)

    removed = chunks.remove_except({sha256_hex(k) for k in keep})

    assert removed == 3
    assert all(chunks.has(sha256_hex(k)) for k in keep)
    assert not any(chunks.has(sha256_hex(d)) for d in drop)
    assert chunks.remove_except({sha256_hex(k) for k in keep}) == 0


# --- versions --------------------------------------------------------------------------------

def test_install_assembles_identical_files(chunks: ChunkStore, versions: VersionStore, key: PolicyKey) -> None:
    manifest, envelope, pieces = build(7, key)
    put_all(chunks, pieces)

    path = versions.install(manifest, envelope, chunks)

    assert path == versions.dir(7) == versions.root / "v00000007"
    assert {p.name: p.read_bytes() for p in path.iterdir()} == FILES
    assert versions.manifest_path(7).read_bytes() == envelope
    assert versions.manifest_bytes(7) == envelope
    assert versions.manifest_bytes(8) is None
    assert versions.versions() == [7]
    assert versions.latest() == 7
    # Installing again is a no-op.
    assert versions.install(manifest, envelope, chunks) == path


def test_versions_and_latest(chunks: ChunkStore, versions: VersionStore, key: PolicyKey) -> None:
    assert versions.versions() == []
    assert versions.latest() is None
    for v in (12, 3, 9):
        manifest, envelope, pieces = build(v, key, {"w.bin": f"weights-{v}".encode()})
        put_all(chunks, pieces)
        versions.install(manifest, envelope, chunks)
    assert versions.versions() == [3, 9, 12]
    assert versions.latest() == 12
    versions.remove(12)
    assert versions.versions() == [3, 9]
    assert not versions.dir(12).exists()


def test_a_version_without_its_manifest_is_not_listed(chunks: ChunkStore, versions: VersionStore, key: PolicyKey) -> None:
    # The manifest is written last: a directory alone (crash before the manifest) is not a version.
    versions.dir(5).mkdir()
    (versions.dir(5) / "w.bin").write_bytes(b"half")
    assert versions.versions() == []

    manifest, envelope, pieces = build(5, key)
    put_all(chunks, pieces)
    versions.install(manifest, envelope, chunks)
    assert versions.versions() == [5]
    assert {p.name for p in versions.dir(5).iterdir()} == set(FILES)


def test_install_with_a_missing_chunk_leaves_nothing(chunks: ChunkStore, versions: VersionStore, key: PolicyKey) -> None:
    manifest, envelope, pieces = build(4, key)
    put_all(chunks, pieces[:-2])

    with pytest.raises(FileNotFoundError):
        versions.install(manifest, envelope, chunks)

    assert versions.versions() == []
    assert list(versions.root.iterdir()) == []
    assert not versions.manifest_path(4).exists()


def test_install_with_corrupt_chunk_on_disk_is_refused(chunks: ChunkStore, versions: VersionStore, key: PolicyKey) -> None:
    manifest, envelope, pieces = build(4, key)
    put_all(chunks, pieces)
    chunks.path(sha256_hex(pieces[0])).write_bytes(b"XXXX")  # bit rot after verification

    with pytest.raises(ChunkHashError):
        versions.install(manifest, envelope, chunks)

    assert versions.versions() == []
    assert list(versions.root.iterdir()) == []


def test_clean_temporaries(versions: VersionStore, chunks: ChunkStore, key: PolicyKey) -> None:
    manifest, envelope, pieces = build(2, key)
    put_all(chunks, pieces)
    versions.install(manifest, envelope, chunks)
    (versions.root / ".tmp-v3-abc").mkdir()
    (versions.root / ".tmp-v3-abc" / "w.bin").write_bytes(b"partial")
    (versions.root / ".tmp-xyz").write_bytes(b"partial manifest")

    versions.clean_temporaries()

    assert sorted(p.name for p in versions.root.iterdir()) == ["v00000002", "v00000002.manifest"]
    assert versions.versions() == [2]


def test_an_assembly_written_as_chunks_arrive_installs_by_rename(chunks: ChunkStore, versions: VersionStore,
                                                                key: PolicyKey) -> None:
    # "abcd" twice: one chunk, two places in the file.
    files = {"model.safetensors": b"abcdXYZWabcd1234", "config.json": b'{"a": 1}'}
    manifest, envelope, pieces = build(3, key, files)
    assert len(manifest.chunk_refs()) < sum(len(f.chunks) for f in manifest.files)
    arrived, stored_before = pieces[: len(pieces) // 2], pieces[len(pieces) // 2:]
    put_all(chunks, stored_before)  # held from an earlier version: never fetched, filled at commit
    assembly = versions.begin(manifest)
    for piece in arrived:
        chunks.put(sha256_hex(piece), piece)
        assembly.write(sha256_hex(piece), piece)
    assert versions.versions() == []  # nothing is visible before the commit

    path = versions.commit(assembly, envelope, chunks)

    assert {p.name: p.read_bytes() for p in path.iterdir()} == files
    assert versions.versions() == [3] and not any(p.name.startswith(".tmp-") for p in versions.root.iterdir())


def test_an_assembly_refuses_a_stored_chunk_that_rotted_and_leaves_nothing(chunks: ChunkStore, versions: VersionStore,
                                                                          key: PolicyKey) -> None:
    manifest, envelope, pieces = build(6, key)
    put_all(chunks, pieces)
    chunks.path(sha256_hex(pieces[0])).write_bytes(b"XXXX")
    assembly = versions.begin(manifest)

    with pytest.raises(ChunkHashError):
        versions.commit(assembly, envelope, chunks)

    assert versions.versions() == [] and list(versions.root.iterdir()) == []


# --- garbage collection ----------------------------------------------------------------------

def test_garbage_collection_keeps_the_newest_versions_and_those_in_use(
    chunks: ChunkStore, versions: VersionStore, key: PolicyKey,
) -> None:
    """A rollout engine still reads the version it last loaded, however many came after it."""
    own_chunk: dict[int, bytes] = {}
    for v in range(1, 6):
        files = {**FILES, "model.safetensors": f"v{v}-weights".encode()}  # one chunk of its own a version
        manifest, envelope, pieces = build(v, key, files)
        put_all(chunks, pieces)
        versions.install(manifest, envelope, chunks)
        own_chunk[v] = f"v{v}-weights".encode()[:CHUNK]
    assert own_chunk[1] != own_chunk[2]

    assert collect_garbage(versions, chunks, keep=2, in_use={2}) == [1, 3]
    assert versions.versions() == [2, 4, 5]
    assert (versions.dir(2) / "model.safetensors").read_bytes() == b"v2-weights"
    assert chunks.has(sha256_hex(own_chunk[2])) and not chunks.has(sha256_hex(own_chunk[1]))

    # Once nothing uses it, it goes like any other old version.
    assert collect_garbage(versions, chunks, keep=2) == [2]
    assert versions.versions() == [4, 5] and not versions.dir(2).exists()
    assert collect_garbage(versions, chunks, keep=2, in_use={4, 5}) == []
