"""A restarted learner takes its delta bases (the last version and its keyframe) from its own store."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from echo2swarm.learner.publisher import Publisher
from echo2swarm.learner.versions import DeltaBase, VersionWriter
from echo2swarm.policy.delta import tensor_sha256
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.wire.signing import PolicyKey

PEER_ID = "12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"


def _publish(root: Path, n: int) -> tuple[VersionStore, list[dict[str, torch.Tensor]]]:
    versions = VersionStore(root)
    writer = VersionWriter("s", PolicyKey.generate(), ChunkStore(root), versions, 64 * 1024, PEER_ID)
    states = [{"w": torch.full((64, 64), 0.01 * (1 + i), dtype=torch.bfloat16)} for i in range(n)]
    previous = keyframe = None
    for v, state in enumerate(states, start=1):
        p = writer.write_state(state, {"config.json": b"{}"}, v, previous=previous, keyframe=keyframe,
                                    keyframe_every=3, max_ratio=1.0)
        previous = DeltaBase(v, p.manifest_sha256, state)
        keyframe = previous if p.kind == "dense" else keyframe
    return versions, states


def test_bases_come_back_from_the_store_after_a_restart(tmp_path: Path):
    versions, states = _publish(tmp_path, 5)  # v1 dense, v2-3 deltas, v4 dense, v5 delta
    service = SimpleNamespace(versions=versions, previous=None, keyframe=None)
    Publisher._load_bases(service, states[-1])  # type: ignore[arg-type]
    assert (service.previous.version, service.keyframe.version) == (5, 4)
    assert tensor_sha256(service.previous.tensors["w"]) == tensor_sha256(states[4]["w"])
    assert service.previous.manifest_sha256 == sha(versions, 5) and service.keyframe.manifest_sha256 == sha(versions, 4)


def test_a_model_with_other_tensors_or_dtypes_starts_with_a_keyframe(tmp_path: Path):
    versions, _ = _publish(tmp_path, 2)
    for state in ({"w": torch.zeros((64, 64), dtype=torch.float32)}, {"v": torch.zeros((64, 64), dtype=torch.bfloat16)}):
        service = SimpleNamespace(versions=versions, previous=None, keyframe=None)
        Publisher._load_bases(service, state)  # type: ignore[arg-type]
        assert service.previous is None and service.keyframe is None


def sha(versions: VersionStore, v: int) -> str:
    from echo2swarm.policy.manifest import sha256_hex

    data = versions.manifest_bytes(v)
    assert data is not None
    return sha256_hex(data)
