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

import contextlib
import hashlib
import os
import shutil
import threading
from collections.abc import Collection, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from echo2swarm.config.models import MAX_KEYFRAME_EVERY
from echo2swarm.policy.manifest import DeltaFile, Manifest, sha256_hex
from echo2swarm.runtime.logging import get_logger
from echo2swarm.runtime.safetensors import ITEMSIZE, TensorSlot, safetensors_layout

if TYPE_CHECKING:
    import numpy as np

    from echo2swarm.policy.orders import Moved, TensorOrder

logger = get_logger(__name__)
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))  # tensors hashed at once (hashlib lets go of the GIL)
ORDERS_NICE = 10  # the orders thread's nice: it yields to the peer's own work (a nice-0 thread gets ~10x its share)
MAX_CHAIN = MAX_KEYFRAME_EVERY  # manifests a follower walks back from the target at most
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


_UINT = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def sha256_views(views: Mapping[str, "np.ndarray"]) -> dict[str, str]:
    """sha256 hex digest of each view's bytes (contiguous arrays, e.g. slices of a memory map),
    HASH_THREADS at a time: a big model's tensors hash in a fraction of one core's time."""
    def one(item: tuple[str, "np.ndarray"]) -> tuple[str, str]:
        return item[0], hashlib.sha256(item[1]).hexdigest()

    if HASH_THREADS < 2 or len(views) < 2:
        return dict(map(one, views.items()))
    from concurrent.futures import ThreadPoolExecutor

    # the largest first, so that the last one to finish is a small one
    items = sorted(views.items(), key=lambda item: -item[1].nbytes)
    with ThreadPoolExecutor(min(HASH_THREADS, len(items)), thread_name_prefix="sha256") as pool:
        return dict(pool.map(one, items))


def _safetensors_layout(path: Path, size: int, reason: str = "wrong_base") -> dict[str, TensorSlot]:
    """The tensors of a safetensors file (runtime/safetensors.py); DeltaRefused(`reason`) when its header
    is not one a version's file may have."""
    try:
        return safetensors_layout(path, size)
    except ValueError as e:
        raise DeltaRefused(reason, str(e)) from None


def _check_slots(manifest: Manifest, slots: Mapping[str, TensorSlot]) -> None:
    """DeltaRefused unless the file's tensors are the manifest's: the same names, dtypes and shapes."""
    expected = {t.name: t for t in manifest.tensors}
    if set(slots) != set(expected):
        raise DeltaRefused("tensor_names", f"v{manifest.version}: rebuilt tensors "
                           f"{sorted(set(slots) ^ set(expected))[:3]} differ from the manifest's")
    for name, slot in slots.items():
        info = expected[name]
        if slot.dtype != info.dtype or slot.shape != info.shape:
            raise DeltaRefused("tensor_shape", f"v{manifest.version}: {name} is {slot.dtype}{slot.shape}, "
                               f"the manifest says {info.dtype}{info.shape}")


def _check_hashes(manifest: Manifest, views: Mapping[str, "np.ndarray"], want: Mapping[str, str]) -> None:
    """DeltaRefused("tensor_hash") unless each tensor named in `want` hashes to its signed sha256."""
    digests = sha256_views({name: views[name] for name in want})
    wrong = sorted(name for name, sha in want.items() if digests[name] != sha)
    if wrong:
        raise DeltaRefused("tensor_hash", f"v{manifest.version}: {wrong[0]} does not match its signed sha256"
                           + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""))


def rebuild(manifest: Manifest, delta: DeltaFile, base_dir: Path, base: Manifest, blob: bytes, out: Path,
            orders: "MutableMapping[str, TensorOrder] | None" = None,
            moved: "dict[str, list[Moved]] | None" = None) -> list[str]:
    """Write the version's weights file at `out`, rebuilt from the base version's installed weights
    and `blob`, every tensor checked against the manifest; DeltaRefused otherwise (`out` removed).
    Returns the names of the tensors the delta changed.

    Written once: `out` starts as a copy of the base's file (the kernel copies it), the delta is
    applied in place through a memory map, and only the tensors it changed are hashed. An unchanged
    tensor is the base's, which was checked against the base's signed hash when the base was
    installed: it passes when the new manifest signs that same hash (else it is hashed, and refused
    unless it matches).

    `orders`: the base's visiting orders (`BaseOrders.take`), any subset of its tensors; `moved` is
    filled with what advancing them into the rebuilt version's takes (`apply_delta_bits`,
    `BaseOrders.follow`). The orders decide both where changes land and the class sizes the delta is
    checked against, so a rebuild with orders that is refused for any reason is done again without
    them (they are emptied): a wrong order of ours (a bug) never refuses a right delta, and a wrong
    delta is refused as it would be without orders.
    """
    try:
        return _rebuild(manifest, delta, base_dir, base, blob, out, orders, moved)
    except DeltaRefused as e:
        if not orders:
            raise
        logger.warning("v%d: the rebuild with visiting orders computed ahead was refused (%s); "
                       "rebuilding without them", manifest.version, e.reason)
        orders.clear()
        if moved is not None:
            moved.clear()
        return _rebuild(manifest, delta, base_dir, base, blob, out, None, None)


def _rebuild(manifest: Manifest, delta: DeltaFile, base_dir: Path, base: Manifest, blob: bytes, out: Path,
             orders: "MutableMapping[str, TensorOrder] | None", moved: "dict[str, list[Moved]] | None") -> list[str]:
    import numpy as np

    from echo2swarm.policy.delta import DeltaError, apply_delta_bits

    if hashlib.sha256(blob).hexdigest() != delta.file.sha256:  # every chunk was checked; the whole, again
        raise DeltaRefused("blob_hash", f"v{manifest.version}: the assembled delta does not match its sha256")
    if base.weights_file is None:
        raise DeltaRefused("wrong_base", f"v{manifest.version}: base v{base.version} has no single weights file")
    shutil.copyfile(base_dir / base.weights_file, out)
    try:
        size = out.stat().st_size
        slots = _safetensors_layout(out, size)
        # A shared map of the copy (numpy's: it is unmapped when the last view goes, even one an
        # exception's traceback still holds): the delta's changes land in the file itself.
        mm = np.memmap(out, dtype=np.uint8, mode="r+", shape=(size,))
        bits = {name: mm[s.start:s.end].view(_UINT[ITEMSIZE[s.dtype]]) for name, s in slots.items()}
        try:
            changed = apply_delta_bits(bits, blob, orders, moved)
        except DeltaError as e:
            raise DeltaRefused(e.reason, f"v{manifest.version} from v{base.version}: {e}") from None
        _check_slots(manifest, slots)
        signed_before = {t.name: t.sha256 for t in base.tensors}
        touched = set(changed)
        _check_hashes(manifest, bits, {t.name: t.sha256 for t in manifest.tensors if t.sha256 is not None
                                       and (t.name in touched or signed_before.get(t.name) != t.sha256)})
        del bits, mm  # a shared map: its writes are the file's (no flush: nothing here is fsynced either)
        return changed
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def weights_bits(path: Path) -> "dict[str, np.ndarray]":
    """A safetensors file's tensors as flat unsigned arrays of their item size, read-only views of a map."""
    import numpy as np

    size = path.stat().st_size
    slots = _safetensors_layout(path, size)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=(size,))
    return {name: mm[s.start:s.end].view(_UINT[ITEMSIZE[s.dtype]]) for name, s in slots.items()}


class BaseOrders:
    """The visiting orders (policy/orders.py) of the version a follower holds, so that rebuilding
    the next delta against it neither sorts nor counts.

    Kept up to date off the critical path (`follow`, after each install), in one thread niced to
    ORDERS_NICE where the OS allows (Linux: per thread) so that it yields to the peer's own work:
    after a delta rebuild it advances the orders the rebuild used by the items whose key changed
    (tensors without such items are ready at once; a tensor where more than
    orders.ADVANCE_MAX_SHARE of the items did is sorted instead); after a dense install (a keyframe, a
    new joiner), or for tensors the rebuild had none for, it sorts them. It publishes each tensor's
    order as it completes. `take(version, sha)` stops it and returns the tensors done so far for
    that exact version and manifest (the rebuild sorts the others itself), or None for any other
    base. Memory: 4 bytes per item of the held weights, only when they have at most
    `max_items` items (0: never). A wrong order could only rebuild tensors that fail their hash
    check, and `rebuild` then redoes it without orders: it never installs or refuses anything.
    """

    def __init__(self, max_items: int):
        self.max_items = max_items
        self._key: tuple[int, str] | None = None
        self._orders: "dict[str, TensorOrder]" = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, version: int, manifest_sha256: str, manifest: Manifest, weights: Path,
               orders: "dict[str, TensorOrder] | None" = None, moved: "dict[str, list[Moved]] | None" = None) -> None:
        """Hold the orders of `version` (installed, its weights at `weights`), made in the background:
        `orders` (those a rebuild of it used, possibly partial) advanced by `moved` (what that rebuild
        reported; tensors without moved items are ready at once), then every other tensor sorted."""
        self.stop()
        numel = sum(_numel(t.shape) for t in manifest.tensors)
        if not 0 < numel <= self.max_items:
            return
        orders, moved = orders or {}, moved or {}
        done = {name: o for name, o in orders.items() if name not in moved}
        pending = {name: o for name, o in orders.items() if name in moved}
        self._key, self._orders = (version, manifest_sha256), done
        if len(done) >= _multibyte(manifest):
            return
        stop = threading.Event()
        self._stop = stop

        def work() -> None:
            from echo2swarm.policy.orders import advance, visit_orders, worth_advancing

            with contextlib.suppress(OSError, AttributeError):  # a low priority, for this thread only
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ORDERS_NICE)
            for name, entry in pending.items():
                if stop.is_set():
                    return
                if not worth_advancing(entry, moved[name]):  # many items changed key: sorted below
                    continue
                if advance(entry, moved[name]):
                    done[name] = entry
                else:  # not of these bits (a bug): sorted below instead
                    logger.warning("v%d: the visiting order of %s could not be advanced; sorting it", version, name)
            try:
                visit_orders(weights_bits(weights), stop=stop.is_set, out=done)
            except (OSError, ValueError, DeltaRefused) as e:  # the version went away (GC), or an odd file
                logger.debug("visiting orders of v%d not computed: %s", version, e)

        self._thread = threading.Thread(target=work, name=f"orders-v{version}", daemon=True)
        self._thread.start()

    def take(self, version: int, manifest_sha256: str) -> "dict[str, TensorOrder] | None":
        """The tensors' orders done so far for exactly that base (the computation stops); else None."""
        key, orders = self._key, self._orders
        self.stop()
        return dict(orders) if key == (version, manifest_sha256) else None

    def stop(self) -> None:
        self._stop.set()
        self._key, self._orders = None, {}


def _multibyte(manifest: Manifest) -> int:
    """Tensors of the manifest with items of more than one byte (those that have a visiting order)."""
    return sum(ITEMSIZE.get(_DTYPES.get(t.dtype, ""), 2) > 1 for t in manifest.tensors)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_dense(manifest: Manifest, version_dir: Path) -> None:
    """A dense version's weights files against the manifest: the same tensors, dtypes and shapes, and
    each tensor's signed sha256 (when the manifest carries them); DeltaRefused otherwise.

    Read through memory maps and hashed in place, HASH_THREADS tensors at a time (no copies)."""
    if not manifest.tensors or all(t.sha256 is None for t in manifest.tensors):
        return
    import numpy as np

    slots: dict[str, TensorSlot] = {}
    views: dict[str, np.ndarray] = {}
    for file in sorted({t.file for t in manifest.tensors}):
        path = version_dir / file
        size = path.stat().st_size
        layout = _safetensors_layout(path, size, reason="tensor_shape")
        named = {t.name for t in manifest.tensors if t.file == file}
        if set(layout) != named:
            raise DeltaRefused("tensor_names", f"v{manifest.version}: {file} holds tensors "
                               f"{sorted(set(layout) ^ named)[:3]} that the manifest does not put there")
        mm = np.memmap(path, dtype=np.uint8, mode="r", shape=(size,))
        slots.update(layout)
        views.update({name: mm[s.start:s.end] for name, s in layout.items()})
    _check_slots(manifest, slots)
    _check_hashes(manifest, views, {t.name: t.sha256 for t in manifest.tensors if t.sha256 is not None})
