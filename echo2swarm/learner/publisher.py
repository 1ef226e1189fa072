"""The learner's published versions, owned in one place: the head, the delta chain, keyframes, what is kept.

    Publisher(config.publish, ...)      publish.dtype resolved once, from the model directory
      .publish(trainer, version)        at start (after a restart the store's last version and its
                                        keyframe become the delta bases, when their tensors fit), then every κ steps:
            trainer.weights_state(dtype, held against the previous version, publish.hold_ulps)
              ─► VersionWriter.write_state: keyframe or delta (+ composite), chunks, signed manifest
              ─► previous / keyframe / chain bytes move on ─► stores keep versions_kept + the chain
      .rollback_weights()               the newest published tensors, when the policy went non-finite
      .head(ttl, chunk_url, maddrs)     a freshly signed head of the newest version, per announcement

Nothing here trains or talks to peers: the learner (learner/loop.py) calls these from a worker
thread between steps, then tells the broadcast tracker and the intake.
"""

from __future__ import annotations

from collections import Counter, deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2swarm.config.models import PublishConfig
from echo2swarm.learner.versions import WEIGHTS_FILE, DeltaBase, PublishedVersion, VersionWriter, model_files
from echo2swarm.policy.manifest import sha256_hex
from echo2swarm.policy.store import ChunkStore, VersionStore, collect_garbage
from echo2swarm.runtime.logging import get_logger
from echo2swarm.train.base import Trainer
from echo2swarm.wire.records import HeadRecord
from echo2swarm.wire.signing import PolicyKey

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)
HISTORY = 16  # recent versions whose figures stats() reports


class Publisher:
    """>>> publisher = Publisher(config.publish, keep=config.versions_kept, swarm="demo", key=key,
    ...                       chunks=chunks, versions=versions, peer_id=overlay.peer_id)
    >>> publisher.publish(trainer, version=1)
    >>> publisher.publish(trainer, version=2)      # NonFiniteWeightsError: nothing signed
    >>> head = publisher.head(ttl_s=30)
    """

    def __init__(self, config: PublishConfig, *, keep: int, swarm: str, key: PolicyKey, chunks: ChunkStore,
                 versions: VersionStore, peer_id: str):
        from echo2swarm.train.rounding import publish_dtype

        assert config.model is not None  # LearnerConfig refuses a learner without one
        self.config = config
        self.keep = keep
        self.versions = versions
        self.chunks = chunks
        self.model_dir = Path(config.model)
        self.dtype: torch.dtype = publish_dtype(config.dtype, self.model_dir)
        self.writer = VersionWriter(swarm, key, chunks, versions, config.chunk_size, peer_id,
                                    delta_chunk_size=config.delta_chunk_size)
        # Weights come from the trainer; a sharded model's index no longer applies to the one file we publish.
        self.extra_files: dict[str, Path | bytes] = {
            p.name: p for p in model_files(self.model_dir)
            if p.suffix != ".safetensors" and p.name != "model.safetensors.index.json"}
        self.published: PublishedVersion | None = None  # the head
        self.previous: DeltaBase | None = None  # its tensors in the publish dtype: the next delta's base
        self.keyframe: DeltaBase | None = None  # the last dense version's
        self.chain_bytes = 0  # deltas published since that keyframe
        self.history: deque[PublishedVersion] = deque(maxlen=HISTORY)
        self.kinds: Counter[str] = Counter()  # versions published, by kind (dense / delta)

    def publish(self, trainer: Trainer, version: int) -> PublishedVersion:
        """Sign the trainer's weights, cast to publish.dtype, as `version`: a keyframe or a delta.

        Raises NonFiniteWeightsError (nothing is written or signed) when a weight is not finite.
        """
        config = self.config
        state = trainer.weights_state(self.dtype, self.previous.tensors if self.previous else None, config.hold_ulps)
        if self.published is None:  # the run's first version: after a restart, a delta on the store's last
            self._load_bases(state)
        published = self.writer.write_state(
            state, self.extra_files, version, previous=self.previous, keyframe=self.keyframe,
            keyframe_every=config.keyframe_every, max_ratio=config.delta_max_ratio, chain_bytes=self.chain_bytes,
            composites=config.composites,
        )
        self.published = published
        self.history.append(published)
        self.kinds[published.kind] += 1
        # A copy: on the CPU in the master dtype, the trainer's cast is the live parameters themselves,
        # which the next step changes in place (the next delta would then be against itself).
        self.previous = DeltaBase(published.version, published.manifest_sha256,
                                  {name: t.clone() for name, t in state.items()})
        if published.kind == "dense":
            self.keyframe, self.chain_bytes = self.previous, 0
        else:
            self.chain_bytes += published.delta_bytes or 0
        # The last keyframe with every version since stays: the paths followers catch up by.
        assert self.keyframe is not None
        collect_garbage(self.versions, self.chunks, self.keep, set(range(self.keyframe.version, version + 1)))
        return published

    def rollback_weights(self) -> "dict[str, torch.Tensor]":
        """The newest published version's tensors (publish dtype; finite, as they were checked when signed)."""
        from safetensors.torch import load_file

        if self.published is None:
            raise RuntimeError("nothing published yet to roll back to")
        if self.previous is not None and self.previous.version == self.published.version:
            return self.previous.tensors
        return load_file(str(self.versions.dir(self.published.version) / WEIGHTS_FILE))

    def _load_bases(self, state: "dict[str, torch.Tensor]") -> None:
        """After a restart: the last version in our store (and its keyframe) as delta bases, when its
        weights have the same tensors and dtypes as `state`; otherwise the next version is a keyframe."""
        from safetensors.torch import load_file

        versions = self.versions
        latest = versions.latest()
        manifest = versions.manifest(latest) if latest is not None else None
        if manifest is None or manifest.weights_file is None or any(t.sha256 is None for t in manifest.tensors):
            return
        keyframe_version = manifest.keyframe.version if manifest.keyframe is not None else manifest.version
        bases = []
        for v in (manifest.version, keyframe_version):
            data = versions.manifest_bytes(v)
            if data is None or not (versions.dir(v) / WEIGHTS_FILE).is_file():
                return
            tensors = load_file(str(versions.dir(v) / WEIGHTS_FILE))
            if set(tensors) != set(state) or any(tensors[k].dtype != state[k].dtype for k in state):
                return
            bases.append(DeltaBase(v, sha256_hex(data), tensors))
        self.previous, self.keyframe = bases
        logger.info("delta base after restart: v%d (keyframe v%d)", self.previous.version, self.keyframe.version)

    def head(self, ttl_s: float, chunk_url: str | None = None, maddrs: list[str] | None = None,
             card_shard_bits: int = 0, verifiers: list[str] | None = None) -> HeadRecord | None:
        """The newest version's head, signed now (None before the first), naming where followers reach us."""
        if self.published is None:
            return None
        return self.writer.sign_head(self.published, ttl_s, chunk_url, maddrs, card_shard_bits, verifiers)

    def card_versions(self) -> list[dict[str, Any]]:
        """The card's `versions`: the newest few, as {version, kind, dense_bytes, delta_bytes}."""
        return [{"version": p.version, "kind": p.kind, "dense_bytes": p.dense_bytes, "delta_bytes": p.delta_bytes}
                for p in list(self.history)[-8:]]

    def stats(self) -> dict[str, Any]:
        """Per recent version: kind, dense / delta / composite bytes, ratio; the newest one's as gauges."""
        out: dict[str, Any] = {"versions": {str(p.version): p.report() for p in self.history}}
        if self.published is not None:
            last = self.published.report()
            out["publish"] = {"dense_bytes": last["dense_bytes"], "delta_bytes": last["delta_bytes"],
                              "composite_bytes": last["composite_bytes"], "delta_ratio": last["ratio"],
                              "kinds": dict(self.kinds)}
        return out
