"""Catching up through delta versions: which path to take, and rebuilding a version bit-exactly.

    target manifest (verified by the head) ─► walk back along `delta.base` links (each manifest
    verified by the sha256 its successor names) until a version we hold or a keyframe
      ─► choose_path: the fewest weight bytes over
           a delta (primary or alternative) from a version we hold         "delta" / "composite"
           the chain of primary deltas from a version we hold              "chain"
           the keyframe (dense), then a composite or the chain after it    "keyframe"
      ─► per hop: fetch its files' chunks (each verified against its hash, stored, re-servable),
         rebuild the weights with apply_delta against the held base, check EVERY tensor's sha256
         against the signed manifest, and only then install the version (a rename).

A hop that fails the rebuild check raises `DeltaRefused` (reason: the counter label): its version
is not installed, its delta's chunks are dropped from the store so they are not served onward, and
the follower plans again without that delta (the keyframe path).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from echo2swarm.policy.manifest import DeltaFile, Manifest, sha256_hex
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
MAX_CHAIN = 64  # manifests a follower walks back from the target at most (publish.keyframe_every <= this)
PATHS = ("delta", "chain", "composite", "keyframe")  # fetch-path labels (bounded: metrics and /v1/info)
# torch dtype name -> safetensors dtype string, for checking a rebuilt tensor against its TensorInfo
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64",
           "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


class DeltaRefused(Exception):
    """A version rebuilt from a delta (or a dense one) that does not match its signed tensor hashes."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Linked:
    """A verified manifest and its envelope's sha256 (what links name)."""

    manifest: Manifest
    envelope: bytes

    @property
    def sha256(self) -> str:
        return sha256_hex(self.envelope)


@dataclass(frozen=True)
class Hop:
    """Install `linked`'s version through `delta` (None: densely)."""

    linked: Linked
    delta: DeltaFile | None

    @property
    def cost(self) -> int:
        """Weight bytes this hop fetches (the non-weight files are the same on every path, and dedupe)."""
        m = self.linked.manifest
        if self.delta is not None:
            return self.delta.file.size
        weights = {t.file for t in m.tensors}
        return sum(f.size for f in m.files if f.name in weights) if weights else m.total_bytes


def choose_path(chain: list[Linked], held: dict[int, str],
                bad: Collection[tuple[int, int, str]] = ()) -> tuple[list[Hop], str] | None:
    """The cheapest hops (fewest weight bytes) to install `chain[0]`, and its path label.

    `chain` is the target first, then the manifests its primary deltas name, walking back; `held`
    maps the versions we have installed to their manifest sha256; `bad` holds (version, base version,
    delta file sha256) of deltas refused before. None: no path (nothing held links in and no keyframe reached).
    """
    n = len(chain)
    best: list[tuple[int, list[Hop]] | None] = [None] * n
    for i in range(n - 1, -1, -1):
        linked = chain[i]
        m = linked.manifest
        if held.get(m.version) == linked.sha256:
            best[i] = (0, [])
            continue
        options: list[tuple[int, list[Hop]]] = []
        if m.delta is None:
            hop = Hop(linked, None)
            options.append((hop.cost, [hop]))
        for d in m.deltas():
            if (m.version, d.base.version, d.file.sha256) in bad:
                continue
            hop = Hop(linked, d)
            if held.get(d.base.version) == d.base.manifest_sha256:
                options.append((hop.cost, [hop]))
            for j in range(i + 1, n):
                if chain[j].manifest.version == d.base.version and chain[j].sha256 == d.base.manifest_sha256:
                    if best[j] is not None:
                        cost, hops = best[j]  # type: ignore[misc]
                        options.append((cost + hop.cost, hops + [hop]))
        if options:
            best[i] = min(options, key=lambda o: (o[0], len(o[1])))
    if best[0] is None:
        return None
    _, hops = best[0]
    return hops, path_label(hops, chain[0].manifest.version)


def path_label(hops: list[Hop], target: int) -> str:
    if not hops:
        return "delta"
    if hops[0].delta is None:
        return "keyframe"
    if any(h.delta is not None and h.delta is not h.linked.manifest.delta and h.delta.base.version
           != h.linked.manifest.version - 1 for h in hops):
        return "composite"
    return "delta" if len(hops) == 1 else "chain"


def check_tensors(manifest: Manifest, tensors: dict[str, object]) -> None:
    """Raise DeltaRefused unless `tensors` are exactly the manifest's: names, dtypes, shapes and sha256."""
    from echo2swarm.policy.delta import tensor_sha256

    expected = {t.name: t for t in manifest.tensors}
    if set(tensors) != set(expected):
        raise DeltaRefused("tensor_names", f"v{manifest.version}: rebuilt tensors "
                           f"{sorted(set(tensors) ^ set(expected))[:3]} differ from the manifest's")
    for name, t in tensors.items():
        info = expected[name]
        dtype = _DTYPES.get(str(t.dtype).removeprefix("torch."))  # type: ignore[attr-defined]
        if dtype != info.dtype or list(t.shape) != info.shape:  # type: ignore[attr-defined]
            raise DeltaRefused("tensor_shape", f"v{manifest.version}: {name} is {dtype}{list(t.shape)}, "  # type: ignore[attr-defined]
                               f"the manifest says {info.dtype}{info.shape}")
        if info.sha256 is not None and tensor_sha256(t) != info.sha256:  # type: ignore[arg-type]
            raise DeltaRefused("tensor_hash", f"v{manifest.version}: rebuilt {name} does not match its signed sha256")


def rebuild(manifest: Manifest, delta: DeltaFile, base_dir: Path, base: Manifest, blob: bytes) -> bytes:
    """The version's weights file (safetensors bytes), rebuilt from the base version's installed
    weights and `blob`, every tensor checked against the manifest. DeltaRefused otherwise."""
    from safetensors.torch import load_file
    from safetensors.torch import save as save_safetensors

    from echo2swarm.policy.delta import DeltaError, apply_delta

    if hashlib.sha256(blob).hexdigest() != delta.file.sha256:  # every chunk was checked; the whole, again
        raise DeltaRefused("blob_hash", f"v{manifest.version}: the assembled delta does not match its sha256")
    if base.weights_file is None:
        raise DeltaRefused("wrong_base", f"v{manifest.version}: base v{base.version} has no single weights file")
    base_tensors = load_file(str(base_dir / base.weights_file))
    try:
        rebuilt = apply_delta(base_tensors, blob)
    except DeltaError as e:
        raise DeltaRefused(e.reason, f"v{manifest.version} from v{base.version}: {e}") from None
    check_tensors(manifest, rebuilt)
    return save_safetensors(rebuilt, metadata={"format": "pt"})


def check_dense(manifest: Manifest, version_dir: Path) -> None:
    """A dense version's tensors against their signed sha256 (when the manifest carries them)."""
    if not manifest.tensors or all(t.sha256 is None for t in manifest.tensors):
        return
    from safetensors.torch import load_file

    tensors: dict[str, object] = {}
    for name in sorted({t.file for t in manifest.tensors}):
        tensors.update(load_file(str(version_dir / name)))
    check_tensors(manifest, tensors)
