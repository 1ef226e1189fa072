"""On-disk stores: content-addressed chunks and installed policy versions.

    state_dir/chunks/ab/abcd...            one file per verified chunk (sha256 name)
    state_dir/versions/v00000007/          a plain Hugging Face model directory
    state_dir/versions/v00000007.manifest  the signed manifest envelope, exactly as served

Every write is write-to-temp then rename, so a crash never leaves a half chunk or half version
that a reader (or the chunk server) could mistake for a whole one. A chunk is only ever stored
after its bytes hash to its name.

A version's files are assembled while its chunks arrive (`Assembly`): each chunk, verified in
memory, is written straight to its places in the files, so installing is a rename rather than a
second read, hash and copy of the whole model. Every byte of an installed file was checked
against its chunk's hash in the signed manifest just before it was written.

A version installed through a delta has the bytes of its dense files too (the rebuilt weights
are the learner's file byte for byte): `VersionStore.copy_chunk` stores such a chunk from the
files when someone asks for it, after hashing it, so every holder serves every path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from echo2swarm.policy.manifest import FileEntry, Manifest
from echo2swarm.runtime.files import atomic_write
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_VERSION_DIR = re.compile(r"v(\d{8,})")
_PLAIN_NAME = re.compile(r"(?!\.)[A-Za-z0-9._-]{1,128}")


@contextlib.contextmanager
def atomic_dir(final: Path, prefix: str = ".tmp-") -> Iterator[Path]:
    """Yield a temp dir beside `final`; on success it replaces `final` in one rename, on error it is removed.

    Readers see either the old directory or the complete new one, never a half-written one.
    """
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=prefix))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class ChunkHashError(ValueError):
    """Bytes that do not hash to the chunk's name; never stored, never served."""


class ChunkStore:
    def __init__(self, root: Path):
        self.root = Path(root) / "chunks"
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        if not _HEX64.fullmatch(sha256):
            raise ValueError(f"not a sha256: {sha256[:80]!r}")
        return self.root / sha256[:2] / sha256

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def put(self, sha256: str, data: bytes) -> None:
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ChunkHashError(f"chunk bytes do not hash to {sha256[:16]}...")
        path = self.path(sha256)
        if not path.exists():
            atomic_write(path, data)

    def discard(self, sha256: str) -> None:
        """Forget a chunk (a refused delta's): it is no longer served."""
        self.path(sha256).unlink(missing_ok=True)

    def get(self, sha256: str) -> bytes:
        return self.path(sha256).read_bytes()

    def clean_temporaries(self) -> None:
        for tmp in self.root.glob("*/.tmp-*"):
            tmp.unlink(missing_ok=True)

    def remove_except(self, keep: set[str]) -> int:
        removed = 0
        for sub in self.root.iterdir():
            for f in sub.iterdir() if sub.is_dir() else []:
                if f.name not in keep:
                    f.unlink(missing_ok=True)
                    removed += 1
        return removed


class VersionStore:
    """Installed versions; `install` assembles a model directory from verified chunks, atomically."""

    def __init__(self, root: Path):
        self.root = Path(root) / "versions"
        self.root.mkdir(parents=True, exist_ok=True)
        # Called with the version after each install (from the installing thread): the chunk server's
        # head long-polls wake on it (policy/server.HeadWatch). A listener must be quick and not raise.
        self.listeners: list[Callable[[int], None]] = []
        # version -> {chunk sha256: (file, offset, size)} of its listed files (`copy_chunk`), built when asked;
        # matched against the installed versions again only when this directory changed (its mtime)
        self._places: dict[int, dict[str, tuple[str, int, int]]] = {}
        self._places_seen: int | None = None
        self._places_lock = threading.Lock()

    def dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def manifest_path(self, version: int) -> Path:
        return self.root / f"v{version:08d}.manifest"

    def versions(self) -> list[int]:
        found = []
        for entry in self.root.iterdir():
            m = _VERSION_DIR.fullmatch(entry.name)
            if m and entry.is_dir() and self.manifest_path(int(m.group(1))).is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def manifest_bytes(self, version: int) -> bytes | None:
        try:
            return self.manifest_path(version).read_bytes()
        except FileNotFoundError:
            return None

    def installed(self, version: int) -> bool:
        return self.dir(version).is_dir() and self.manifest_path(version).is_file()

    def begin(self, manifest: Manifest, files: list[FileEntry] | None = None) -> "Assembly":
        """Start assembling `manifest`'s files (or `files`: a delta path's) in a temp dir; chunks are
        written as they arrive."""
        return Assembly(self.root, manifest, files)

    def commit(self, assembly: "Assembly", envelope: bytes, chunks: ChunkStore,
               extra: dict[str, bytes] | None = None) -> Path:
        """Place the chunks still missing (from `chunks`, re-hashed), then publish the version atomically.

        `extra`: files that are not chunks of the manifest (a delta version's rebuilt, verified weights)."""
        version = assembly.manifest.version
        final = self.dir(version)
        if self.installed(version):
            assembly.abort()
            return final
        try:
            assembly.fill(chunks)
            assembly.close()
            for name, data in (extra or {}).items():
                assembly.path(name).write_bytes(data)
            if final.exists():  # a directory without its manifest: a crash before the manifest was written
                shutil.rmtree(final)
            os.replace(assembly.tmp, final)
        except BaseException:
            assembly.abort()
            raise
        # The manifest goes last: a version counts as installed only once it is there.
        atomic_write(self.manifest_path(version), envelope)
        with self._places_lock:
            self._places.pop(version, None)
            self._places_seen = None  # listed again at the next look, whatever the clock's granularity
        for listener in list(self.listeners):
            try:
                listener(version)
            except Exception:  # a listener's failure must not undo an install
                logger.exception("version store listener failed")
        return final

    def install(self, manifest: Manifest, envelope: bytes, chunks: ChunkStore,
                extra: dict[str, bytes] | None = None) -> Path:
        """Assemble every file of `manifest`'s default path from stored chunks (each re-hashed as it is
        read), add `extra` (a delta version's dense weights), then publish."""
        if self.installed(manifest.version):
            return self.dir(manifest.version)
        files = manifest.path_files(manifest.delta) if manifest.delta is not None else None
        return self.commit(self.begin(manifest, files), envelope, chunks, extra)

    def manifest(self, version: int) -> Manifest | None:
        """The installed manifest of `version` (parsed, not re-verified: it was verified when installed)."""
        from echo2swarm.policy.manifest import SignedManifest

        data = self.manifest_bytes(version)
        return None if data is None else SignedManifest.model_validate_json(data).manifest

    def remove(self, version: int) -> None:
        self.manifest_path(version).unlink(missing_ok=True)
        shutil.rmtree(self.dir(version), ignore_errors=True)
        with self._places_lock:
            self._places.pop(version, None)
            self._places_seen = None  # listed again at the next look, whatever the clock's granularity

    def chunk_places(self, sha256: str) -> list[tuple[int, str, int, int]]:
        """Where installed versions' listed files hold chunk `sha256`: (version, file, offset, size).

        Asked of every chunk request this peer cannot answer from its store (a flood of made-up names
        included): one stat of the versions directory, the listing only when it changed."""
        changed = self.root.stat().st_mtime_ns
        with self._places_lock:
            if changed == self._places_seen:
                return [(v, *where[sha256]) for v, where in self._places.items() if sha256 in where]
            self._places_seen = changed
            held = set(self.versions())
            for version in self._places.keys() - held:
                del self._places[version]
            for version in held - self._places.keys():
                manifest, places = self.manifest(version), {}
                for entry in manifest.files if manifest is not None else []:
                    offset = 0
                    for ref in entry.chunks:
                        places.setdefault(ref.sha256, (entry.name, offset, ref.size))
                        offset += ref.size
                self._places[version] = places
            return [(v, *where[sha256]) for v, where in self._places.items() if sha256 in where]

    def copy_chunk(self, sha256: str, chunks: ChunkStore) -> bool:
        """Store chunk `sha256` read from an installed version's files where its manifest lists it: a chunk
        of a path this peer did not fetch (the dense weights it rebuilt from a delta are those bytes), so
        it can be served onward. Kept only if the bytes hash to `sha256`. True: stored."""
        for version, name, offset, size in self.chunk_places(sha256):
            try:
                with open(self.dir(version) / name, "rb") as f:
                    f.seek(offset)
                    data = f.read(size)
            except OSError:  # garbage-collected meanwhile
                continue
            if hashlib.sha256(data).hexdigest() == sha256:
                chunks.put(sha256, data)
                return True
        return False

    def clean_temporaries(self) -> None:
        for entry in self.root.iterdir():
            if entry.name.startswith(".tmp-"):
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)


class Assembly:
    """One version's files in a temp dir, sized up front; `write` puts a verified chunk at each of its offsets.

    Thread-safe for concurrent `write`s (each is a set of positioned writes to distinct ranges).
    """

    def __init__(self, root: Path, manifest: Manifest, files: list[FileEntry] | None = None):
        self.manifest = manifest
        self.files = list(manifest.files if files is None else files)
        self.tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-v{manifest.version}-"))
        self._fds: list[int] = []
        self._places: dict[str, list[tuple[int, int]]] = {}  # sha256 -> (fd, offset) of every copy
        self._written: set[str] = set()
        self._lock = threading.Lock()
        try:
            for entry in self.files:
                fd = os.open(self.tmp / entry.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self._fds.append(fd)
                os.ftruncate(fd, entry.size)
                offset = 0
                for ref in entry.chunks:
                    self._places.setdefault(ref.sha256, []).append((fd, offset))
                    offset += ref.size
        except BaseException:
            self.abort()
            raise

    def path(self, name: str) -> Path:
        """Where a file that is not a chunk of the manifest goes (a delta version's rebuilt weights):
        a plain file name only, so no path from a manifest can leave the version's directory."""
        if not _PLAIN_NAME.fullmatch(name):
            raise ValueError(f"not a plain file name: {name[:80]!r}")
        return self.tmp / name

    def write(self, sha256: str, data: bytes) -> None:
        """Place a chunk whose bytes the caller has checked against `sha256` (the signed manifest's)."""
        view = memoryview(data)
        for fd, offset in self._places.get(sha256, ()):
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        with self._lock:
            self._written.add(sha256)

    def fill(self, chunks: ChunkStore) -> None:
        """Place the chunks nobody wrote (already stored before this fetch), hashing each as it is read."""
        with self._lock:
            missing = self._places.keys() - self._written
        for sha256 in missing:
            data = chunks.get(sha256)
            if hashlib.sha256(data).hexdigest() != sha256:
                raise ChunkHashError(f"stored chunk {sha256[:16]}... no longer matches its hash")
            self.write(sha256, data)

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def abort(self) -> None:
        self.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def collect_garbage(versions: VersionStore, chunks: ChunkStore, keep: int, in_use: Collection[int] = ()) -> list[int]:
    """Keep the newest `keep` versions, the versions in `in_use`, and the chunks they reference;
    returns the versions removed.

    `in_use` is what a reader still needs on disk: a rollout engine reads a version's files when
    its queued load runs, and a restarted engine process starts from the last version it loaded,
    both of which can be older than the newest `keep` while the learner publishes fast.
    """
    from echo2swarm.policy.manifest import SignedManifest

    held = versions.versions()
    drop = [v for v in (held[:-keep] if keep > 0 else held) if v not in in_use]
    if not drop:
        return []
    for v in drop:
        versions.remove(v)
    kept = [v for v in held if v not in drop]
    referenced: set[str] = set()
    for v in kept:
        data = versions.manifest_bytes(v)
        if data:
            referenced.update(ref.sha256 for ref in SignedManifest.model_validate_json(data).manifest.all_chunk_refs())
    removed = chunks.remove_except(referenced)
    logger.debug("garbage-collected versions %s and %d chunks", drop, removed)
    return drop
