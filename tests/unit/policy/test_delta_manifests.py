"""Delta versions: manifest rules, the keyframe decision, the follower's path choice, rebuild checks and GC."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from echo2swarm.learner.versions import WEIGHTS_FILE, DeltaBase, VersionWriter, keyframe_due
from echo2swarm.policy.catchup import DeltaRefused, Linked, check_dense, choose_path, rebuild
from echo2swarm.policy.delta import encode_delta, tensor_sha256
from echo2swarm.policy.manifest import (
    BaseRef,
    DeltaFile,
    Manifest,
    ManifestError,
    TensorInfo,
    file_entry,
    sha256_hex,
    verify_linked_manifest,
)
from echo2swarm.policy.store import ChunkStore, VersionStore, collect_garbage
from echo2swarm.wire.signing import PolicyKey

PEER_ID = "12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"
SHA = "ab" * 32


def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    state = {"w": (torch.randn(128, 64, generator=g) * 0.02).bfloat16(), "b": torch.randn(64, generator=g).bfloat16()}
    out = [state]
    for _ in range(n - 1):
        state = {k: (t.float() * (1 + 0.02 * (torch.rand(t.shape, generator=g) < 0.03))).bfloat16() for k, t in state.items()}
        out.append(state)
    return out


def _delta_manifest(**overrides: object) -> Manifest:
    config, _ = file_entry("config.json", b"{}", 4)
    delta, _ = file_entry("delta-from-v00000002.e2sd", b"0123456789", 4)
    fields: dict[str, object] = dict(
        swarm="s", version=3, created_ms=1, chunk_size=4, files=[config],
        tensors=[TensorInfo(name="w", dtype="BF16", shape=[2], file=WEIGHTS_FILE, sha256=SHA)],
        delta=DeltaFile(base=BaseRef(version=2, manifest_sha256=SHA), file=delta),
        keyframe=BaseRef(version=1, manifest_sha256=SHA),
    )
    fields.update(overrides)
    return Manifest(**fields)  # type: ignore[arg-type]


def test_a_delta_manifest_validates_and_its_default_path_is_config_plus_delta():
    m = _delta_manifest()
    assert m.weights_file == WEIGHTS_FILE and m.dense_bytes == 4
    assert [c.sha256 for c in m.chunk_refs()] == [c.sha256 for c in m.files[0].chunks + m.delta.file.chunks]  # type: ignore[union-attr]
    assert m.total_bytes == 2 + 10
    with pytest.raises(ValueError, match="no dense path"):
        m.path_files(None)


@pytest.mark.parametrize("overrides, message", [
    ({"keyframe": None}, "older keyframe"),
    ({"tensors": [TensorInfo(name="w", dtype="BF16", shape=[2], file=WEIGHTS_FILE)]}, "sha256"),
    ({"tensors": [TensorInfo(name="w", dtype="BF16", shape=[2], file="config.json", sha256=SHA)]}, "rebuilt"),
    ({"delta": DeltaFile(base=BaseRef(version=3, manifest_sha256=SHA), file=file_entry("d.e2sd", b"x", 4)[0])}, "older"),
    ({"delta": DeltaFile(base=BaseRef(version=2, manifest_sha256=SHA), file=file_entry("config.json", b"x", 4)[0])},
     "differ"),
    ({"delta": DeltaFile(base=BaseRef(version=2, manifest_sha256=SHA), file=file_entry("d.e2sd", b"x" * 9, 8)[0])},
     "larger than chunk_size"),
    ({"alternatives": [DeltaFile(base=BaseRef(version=2, manifest_sha256=SHA), file=file_entry("e.e2sd", b"x", 4)[0])]},
     "own base"),
    ({"tensors": [TensorInfo(name="w", dtype="BF16", shape=[2], file="../x", sha256=SHA)]}, "plain file name"),
])
def test_malformed_delta_manifests_are_refused(overrides: dict[str, object], message: str):
    with pytest.raises(ValidationError, match=message):
        _delta_manifest(**overrides)


def test_a_dense_manifest_has_no_keyframe_and_at_most_eight_alternatives():
    weights, _ = file_entry(WEIGHTS_FILE, b"abcd", 4)
    tensors = [TensorInfo(name="w", dtype="BF16", shape=[2], file=WEIGHTS_FILE, sha256=SHA)]
    Manifest(swarm="s", version=2, created_ms=1, chunk_size=4, files=[weights], tensors=tensors)
    with pytest.raises(ValidationError, match="keyframe must be unset"):
        Manifest(swarm="s", version=2, created_ms=1, chunk_size=4, files=[weights], tensors=tensors,
                 keyframe=BaseRef(version=1, manifest_sha256=SHA))
    alternatives = [DeltaFile(base=BaseRef(version=v, manifest_sha256=SHA), file=file_entry(f"d{v}", b"x", 4)[0])
                    for v in range(1, 11)]
    with pytest.raises(ValidationError, match="at most 8"):
        Manifest(swarm="s", version=20, created_ms=1, chunk_size=4, files=[weights], tensors=tensors,
                 alternatives=alternatives)


@pytest.mark.parametrize("version, keyframe, delta, expected", [
    (1, None, None, "first"), (5, 1, 10, None), (11, 1, 10, "interval"), (5, 1, 60, "ratio"), (5, 1, 50, None),
])
def test_keyframe_due(version: int, keyframe: int | None, delta: int | None, expected: str | None):
    assert keyframe_due(version, keyframe, delta, 100, keyframe_every=10, max_ratio=0.5) == expected


@pytest.fixture
def published(tmp_path: Path):
    """v1..v7 with keyframes every 4 (v1, v5), as the learner publishes them."""
    key = PolicyKey.generate()
    chunks, versions = ChunkStore(tmp_path), VersionStore(tmp_path)
    writer = VersionWriter("s", key, chunks, versions, 64 * 1024, PEER_ID)
    states, previous, keyframe, chain, kinds = _states(7), None, None, 0, {}
    for v, state in enumerate(states, start=1):
        p = writer.write_state(state, {"config.json": b"{}"}, v, previous=previous, keyframe=keyframe,
                                    keyframe_every=4, max_ratio=0.5, chain_bytes=chain)
        kinds[v] = p.kind
        previous = DeltaBase(v, p.manifest_sha256, state)
        keyframe, chain = (previous, 0) if p.kind == "dense" else (keyframe, chain + (p.delta_bytes or 0))
    linked = {v: Linked(versions.manifest(v), versions.manifest_bytes(v)) for v in range(1, 8)}  # type: ignore[arg-type]
    return key, chunks, versions, states, kinds, linked


def test_the_learner_publishes_keyframes_every_k_and_deltas_with_composites_between(published):
    _, _, versions, states, kinds, linked = published
    assert kinds == {1: "dense", 2: "delta", 3: "delta", 4: "delta", 5: "dense", 6: "delta", 7: "delta"}
    v5, v7 = linked[5].manifest, linked[7].manifest
    assert [d.base.version for d in v5.alternatives] == [4]  # a keyframe offers the delta from v4
    assert v7.delta.base.version == 6 and [d.base.version for d in v7.alternatives] == [5]  # type: ignore[union-attr]
    assert v7.keyframe == BaseRef(version=5, manifest_sha256=linked[5].sha256)
    for v, state in enumerate(states, start=1):  # every version's dense weights are in the learner's store
        m = linked[v].manifest
        assert {t.name: t.sha256 for t in m.tensors} == {k: tensor_sha256(t) for k, t in state.items()}
        assert (versions.dir(v) / WEIGHTS_FILE).is_file()


def _chain(linked: dict[int, Linked], target: int, stop: int) -> list[Linked]:
    return [linked[v] for v in range(target, stop - 1, -1)]


def _route(choice) -> list[tuple[int, int | None]]:
    hops, _ = choice
    return [(h.linked.manifest.version, h.delta.base.version if h.delta else None) for h in hops]


def test_path_choice(published):
    *_, linked = published
    sha = {v: l.sha256 for v, l in linked.items()}
    chain = _chain(linked, 7, 5)  # the walk back from v7 stops at the keyframe v5
    # nothing held: the keyframe, then the cheaper of its composite and the chain
    choice = choose_path(chain, {})
    assert choice is not None and choice[1] == "keyframe" and _route(choice)[0] == (5, None)
    # v6 held: one delta
    assert _route(choose_path(chain, {6: sha[6]})) == [(7, 6)]
    assert choose_path(chain, {6: sha[6]})[1] == "delta"  # type: ignore[index]
    # the keyframe held: its composite
    choice = choose_path(chain, {5: sha[5]})
    assert _route(choice) == [(7, 5)] and choice[1] == "composite"  # type: ignore[index]
    # v4 held (before the keyframe): v5 by its delta from v4, then on
    choice = choose_path(_chain(linked, 7, 4), {4: sha[4]})
    assert choice is not None and _route(choice)[0] == (5, 4) and choice[1] in ("chain", "composite")
    # a held v6 from another learner (different manifest) does not count
    assert _route(choose_path(chain, {6: "0" * 64})) [0] == (5, None)


def test_a_refused_delta_is_planned_around(published):
    *_, linked = published
    sha = {v: l.sha256 for v, l in linked.items()}
    chain = _chain(linked, 7, 5)
    primary = linked[7].manifest.delta
    assert primary is not None
    choice = choose_path(chain, {6: sha[6], 5: sha[5]}, bad={(7, 6, primary.file.sha256)})
    assert _route(choice) == [(7, 5)]
    composite = linked[7].manifest.alternatives[0]
    assert choose_path(chain, {6: sha[6]}, bad={(7, 6, primary.file.sha256), (7, 5, composite.file.sha256)}) is None


def test_rebuild_is_bit_exact_and_refuses_wrong_bases_and_hashes(published, tmp_path: Path):
    _, chunks, versions, states, _, linked = published
    m7 = linked[7].manifest
    assert m7.delta is not None
    blob = b"".join(chunks.get(c.sha256) for c in m7.delta.file.chunks)
    base_before = (versions.dir(6) / WEIGHTS_FILE).read_bytes()
    out = tmp_path / "rebuilt.safetensors"
    changed = rebuild(m7, m7.delta, versions.dir(6), linked[6].manifest, blob, out)
    assert out.read_bytes() == (versions.dir(7) / WEIGHTS_FILE).read_bytes()
    assert changed and set(changed) <= {t.name for t in m7.tensors}
    assert (versions.dir(6) / WEIGHTS_FILE).read_bytes() == base_before  # rebuilt in a copy, never in place
    out.unlink()
    with pytest.raises(DeltaRefused) as e:  # applied to the wrong base: refused as it is read, or by the hashes
        rebuild(m7, m7.delta, versions.dir(4), linked[4].manifest, blob, out)
    assert e.value.reason in ("wrong_base", "tensor_hash")  # the classes (exponents) of v4 differ from v6's, or not
    assert not out.exists()  # a refused rebuild leaves nothing behind
    with pytest.raises(DeltaRefused) as e:
        rebuild(m7, m7.delta, versions.dir(6), linked[6].manifest, blob[:-1] + bytes([blob[-1] ^ 1]), out)
    assert e.value.reason == "blob_hash"
    assert not out.exists()


def test_a_dense_version_is_checked_through_a_map_and_every_mismatch_refused(published, tmp_path: Path):
    """check_dense: the weights file's tensors, dtypes, shapes and sha256 against the manifest."""
    from safetensors.torch import save_file

    _, _, versions, states, _, linked = published
    m5 = linked[5].manifest
    good = (versions.dir(5) / WEIGHTS_FILE).read_bytes()
    check_dense(m5, versions.dir(5))  # as installed: passes
    weights = tmp_path / WEIGHTS_FILE

    def refused(content: bytes | dict[str, torch.Tensor]) -> str:
        if isinstance(content, bytes):
            weights.write_bytes(content)
        else:
            save_file(content, str(weights), metadata={"format": "pt"})
        with pytest.raises(DeltaRefused) as e:
            check_dense(m5, tmp_path)
        return e.value.reason

    assert refused({"w": states[4]["w"]}) == "tensor_names"
    assert refused({**states[4], "extra": states[4]["b"].clone()}) == "tensor_names"
    assert refused({**states[4], "b": states[4]["b"].float()}) == "tensor_shape"
    assert refused({**states[4], "b": states[4]["b"][:32]}) == "tensor_shape"
    assert refused({**states[4], "w": states[3]["w"]}) == "tensor_hash"  # v4's w: a real tensor, not v5's
    flipped = bytearray(good)
    flipped[-1] ^= 1  # the last byte of the last tensor's data
    assert refused(bytes(flipped)) == "tensor_hash"
    assert refused(b"\xff" * 64) == "tensor_shape"  # not a safetensors file
    assert refused(good[:len(good) // 2]) == "tensor_shape"  # cut short: ranges past the end
    weights.write_bytes(good)
    check_dense(m5, tmp_path)


def test_a_delta_against_an_unrelated_base_is_refused_as_wrong_base(published, tmp_path: Path):
    """The held base is another model (other tensors): apply_delta refuses before anything is rebuilt."""
    from safetensors.torch import save_file

    _, chunks, _, _, _, linked = published
    m7 = linked[7].manifest
    assert m7.delta is not None
    blob = b"".join(chunks.get(c.sha256) for c in m7.delta.file.chunks)
    (tmp_path / "other").mkdir()
    save_file({"x": torch.zeros(3, dtype=torch.bfloat16)}, str(tmp_path / "other" / WEIGHTS_FILE))
    with pytest.raises(DeltaRefused) as e:
        rebuild(m7, m7.delta, tmp_path / "other", linked[6].manifest, blob, tmp_path / "out.safetensors")
    # apply_delta's own label: the base's shape bounds the decompression ("too_large") or the header
    assert e.value.reason in ("wrong_base", "too_large", "malformed")
    assert encode_delta  # the codec is the committed one (policy/delta.py)


def test_unchanged_tensors_pass_on_the_base_s_signed_hash_and_are_hashed_when_it_differs(published, tmp_path: Path):
    """A tensor the delta leaves alone is the base's (checked when the base was installed): the rebuild
    takes it without hashing when the new manifest signs the same hash as the base's manifest, and
    refuses a manifest that signs another hash for it."""
    import hashlib

    _, _, versions, states, _, linked = published
    m6, m7 = linked[6].manifest, linked[7].manifest
    assert m7.delta is not None
    new = {**states[6], "b": states[5]["b"]}  # v7's weights with "b" left as v6 had it
    blob = encode_delta(states[5], new)
    delta = m7.delta.model_copy(update={"file": m7.delta.file.model_copy(
        update={"sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)})})
    honest = m7.model_copy(update={"tensors": [t.model_copy(update={"sha256": tensor_sha256(new[t.name])})
                                               for t in m7.tensors]})
    assert {t.name: t.sha256 for t in honest.tensors}["b"] == {t.name: t.sha256 for t in m6.tensors}["b"]
    out = tmp_path / "rebuilt.safetensors"
    assert "b" not in rebuild(honest, delta, versions.dir(6), m6, blob, out)
    from safetensors.torch import load_file

    assert {k: tensor_sha256(t) for k, t in load_file(str(out)).items()} == {k: tensor_sha256(t) for k, t in new.items()}
    out.unlink()
    lying = honest.model_copy(update={"tensors": [t.model_copy(update={"sha256": "0" * 64}) if t.name == "b" else t
                                                  for t in honest.tensors]})
    with pytest.raises(DeltaRefused) as e:
        rebuild(lying, delta, versions.dir(6), m6, blob, out)
    assert e.value.reason == "tensor_hash" and "b" in str(e.value)
    assert not out.exists()


def test_orders_ahead_rebuild_the_same_bytes_advance_and_wrong_ones_are_dropped(published, tmp_path: Path):
    """BaseOrders sorts the held version at low priority; the rebuild with its orders is the same file
    and advances them into the new version's, which BaseOrders then holds without sorting. Orders of
    another version (a bug) rebuild wrong tensors: the rebuild is redone without them."""
    from echo2swarm.policy.catchup import BaseOrders, weights_bits
    from echo2swarm.policy.orders import TensorOrder, visit_orders

    def orders_of(path: Path) -> dict[str, TensorOrder]:
        return dict(visit_orders({k: v.copy() for k, v in weights_bits(path).items()}))

    _, chunks, versions, _, _, linked = published
    m6, m7 = linked[6].manifest, linked[7].manifest
    assert m7.delta is not None
    blob = b"".join(chunks.get(c.sha256) for c in m7.delta.file.chunks)
    orders = BaseOrders(max_items=10**6)
    orders.follow(6, linked[6].sha256, m6, versions.dir(6) / WEIGHTS_FILE)
    assert orders._thread is not None
    orders._thread.join(30)  # done: every tensor's order is there
    ahead = orders.take(6, linked[6].sha256)
    assert ahead is not None and set(ahead) == {t.name for t in m6.tensors}
    assert orders.take(6, linked[6].sha256) is None  # taken once: the next rebuild sorts for itself
    orders.follow(6, linked[6].sha256, m6, versions.dir(6) / WEIGHTS_FILE)
    assert orders.take(5, linked[5].sha256) is None  # another base: nothing (and the computation stops)
    # some tensors sorted ahead, the rest by the rebuild: the same bytes
    out = tmp_path / "partly.safetensors"
    rebuild(m7, m7.delta, versions.dir(6), m6, blob, out, {"w": ahead["w"]})
    assert out.read_bytes() == (versions.dir(7) / WEIGHTS_FILE).read_bytes()
    out = tmp_path / "rebuilt.safetensors"
    ahead = orders_of(versions.dir(6) / WEIGHTS_FILE)
    moved: dict = {}
    rebuild(m7, m7.delta, versions.dir(6), m6, blob, out, ahead, moved)
    assert out.read_bytes() == (versions.dir(7) / WEIGHTS_FILE).read_bytes()
    # BaseOrders advances them (in its thread) into v7's own orders, for the next delta: no sort
    fresh = orders_of(versions.dir(7) / WEIGHTS_FILE)
    orders.follow(7, linked[7].sha256, m7, versions.dir(7) / WEIGHTS_FILE, ahead, moved)  # after installing v7
    if orders._thread is not None:
        orders._thread.join(30)
    advanced = orders.take(7, linked[7].sha256)
    assert advanced is not None and set(advanced) == set(fresh)
    assert all(np.array_equal(advanced[k].order, fresh[k].order) and np.array_equal(advanced[k].counts, fresh[k].counts)
               for k in fresh)
    # ... and when the rebuild had only some tensors' orders, the others are sorted
    some = dict(list(orders_of(versions.dir(6) / WEIGHTS_FILE).items())[:1])
    moved = {}
    rebuild(m7, m7.delta, versions.dir(6), m6, blob, out, some, moved)
    orders.follow(7, linked[7].sha256, m7, versions.dir(7) / WEIGHTS_FILE, some, moved)
    orders._thread.join(30)
    done = orders.take(7, linked[7].sha256)
    assert done is not None and all(np.array_equal(done[k].order, fresh[k].order) for k in fresh)
    out.unlink()
    # Orders of other bits (a bug) rebuild tensors that fail their hash: the rebuild is done again
    # without them (the right delta is not refused because of our own orders), and they are dropped.
    wrong = {name: TensorOrder(o.order[::-1].copy(), o.counts) for name, o in orders_of(versions.dir(6) / WEIGHTS_FILE).items()}
    moved = {}
    rebuild(m7, m7.delta, versions.dir(6), m6, blob, out, wrong, moved)
    assert out.read_bytes() == (versions.dir(7) / WEIGHTS_FILE).read_bytes() and wrong == {} and moved == {}
    small = BaseOrders(max_items=10)  # more items than it may hold: never computed
    small.follow(6, linked[6].sha256, m6, versions.dir(6) / WEIGHTS_FILE)
    assert small._thread is None and small.take(6, linked[6].sha256) is None


@pytest.mark.parametrize("share", [0.0, 1.0], ids=["sorted", "advanced"])
def test_orders_are_advanced_only_while_few_items_changed_key(published, monkeypatch, share: float):
    """Past orders.ADVANCE_MAX_SHARE of a tensor's items changing key, BaseOrders sorts the tensor anew
    instead of advancing its order (cheaper then); either way it holds the new version's orders."""
    from echo2swarm.policy import orders as orders_module
    from echo2swarm.policy.catchup import BaseOrders, weights_bits
    from echo2swarm.policy.orders import visit_orders, worth_advancing

    _, chunks, versions, _, _, linked = published
    m6, m7 = linked[6].manifest, linked[7].manifest
    assert m7.delta is not None
    blob = b"".join(chunks.get(c.sha256) for c in m7.delta.file.chunks)
    ahead = dict(visit_orders({k: v.copy() for k, v in weights_bits(versions.dir(6) / WEIGHTS_FILE).items()}))
    moved: dict = {}
    out = versions.dir(6).parent / "rebuilt.safetensors"
    rebuild(m7, m7.delta, versions.dir(6), m6, blob, out, ahead, moved)
    out.unlink()
    assert moved  # the delta moved items of some tensors to other classes
    monkeypatch.setattr(orders_module, "ADVANCE_MAX_SHARE", share)
    assert all(worth_advancing(ahead[name], items) == (share == 1.0) for name, items in moved.items())
    advanced: list[str] = []
    real_advance = orders_module.advance
    monkeypatch.setattr(orders_module, "advance", lambda entry, items: advanced.append("x") or real_advance(entry, items))
    orders = BaseOrders(max_items=10**6)
    orders.follow(7, linked[7].sha256, m7, versions.dir(7) / WEIGHTS_FILE, ahead, moved)
    if orders._thread is not None:
        orders._thread.join(30)
    held = orders.take(7, linked[7].sha256)
    fresh = visit_orders({k: v.copy() for k, v in weights_bits(versions.dir(7) / WEIGHTS_FILE).items()})
    assert held is not None and set(held) == set(fresh)
    assert all(np.array_equal(held[k].order, fresh[k].order) and np.array_equal(held[k].counts, fresh[k].counts)
               for k in fresh)
    assert len(advanced) == (len(moved) if share == 1.0 else 0)


def test_linked_manifests_are_checked_against_the_link(published):
    key, _, _, _, _, linked = published
    ref = linked[7].manifest.delta.base  # type: ignore[union-attr]
    assert verify_linked_manifest(linked[6].envelope, ref, trusted=key.public, swarm="s").version == 6
    with pytest.raises(ManifestError) as e:
        verify_linked_manifest(linked[5].envelope, ref, trusted=key.public, swarm="s")
    assert e.value.reason == "hash_mismatch"
    with pytest.raises(ManifestError) as e:
        verify_linked_manifest(linked[6].envelope, BaseRef(version=5, manifest_sha256=sha256_hex(linked[6].envelope)),
                               trusted=key.public, swarm="s")
    assert e.value.reason == "version_mismatch"


def test_gc_keeps_the_keyframe_chain_and_every_delta_file_of_kept_versions(published):
    _, chunks, versions, _, _, linked = published
    dropped = collect_garbage(versions, chunks, keep=1, in_use=set(range(5, 8)))
    assert dropped == [1, 2, 3, 4] and versions.versions() == [5, 6, 7]
    for v in (5, 6, 7):  # the composites and alternatives stay servable, not only the default path
        assert all(chunks.has(r.sha256) for r in linked[v].manifest.all_chunk_refs())
