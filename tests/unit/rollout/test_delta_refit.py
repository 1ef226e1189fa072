"""The transformers engine refits a delta version in place: only the tensors whose signed hash changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from echo2swarm.learner.versions import DeltaBase, VersionWriter, model_files
from echo2swarm.policy.delta import tensor_sha256
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.rollout.engines.hf import TransformersEngine
from echo2swarm.wire.signing import PolicyKey

pytestmark = pytest.mark.timeout(300)
PEER_ID = "12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"


def _model_state(engine: TransformersEngine) -> dict[str, str]:
    return {k: tensor_sha256(v.to("cpu", torch.float32)) for k, v in engine.model.state_dict().items()}


def test_a_delta_version_refits_only_the_changed_tensors_and_ends_identical(tmp_path: Path, tiny_model_dir: Path):
    key = PolicyKey.generate()
    chunks, versions = ChunkStore(tmp_path), VersionStore(tmp_path)
    writer = VersionWriter("s", key, chunks, versions, 64 * 1024, PEER_ID)
    extras = {p.name: p for p in model_files(tiny_model_dir) if p.suffix != ".safetensors"}
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    v1 = writer.write_state(state, extras, 1, previous=None, keyframe=None, keyframe_every=10, max_ratio=0.9)
    base = DeltaBase(1, v1.manifest_sha256, state)
    changed = sorted(state)[:2]
    new = {k: (t + 0.5 if k in changed else t) for k, t in state.items()}
    v2 = writer.write_state(new, extras, 2, previous=base, keyframe=base, keyframe_every=10, max_ratio=0.9)
    assert v2.kind == "delta"

    engine = TransformersEngine(versions.dir(1), threads=1)
    try:
        engine.load_weights(versions.dir(2))
        assert engine.last_refit_tensors == len(changed)
        reference = TransformersEngine(versions.dir(2), threads=1)  # a fresh load of v2, for comparison
        try:
            assert _model_state(engine) == _model_state(reference)
        finally:
            reference.close()
        # A directory without a signed manifest beside it: every tensor is loaded, as before.
        engine.load_weights(tiny_model_dir)
        assert engine.last_refit_tensors == len(state)
    finally:
        engine.close()
