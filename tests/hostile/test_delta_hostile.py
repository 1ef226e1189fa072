"""Hostile delta versions against a real relay daemon: a tampered delta chunk, a delta against the
wrong base, and a learner-signed manifest whose tensor hash is wrong.

The "learner" here runs in this process: a real DHT node (Overlay), the real VersionWriter with the
pinned policy key (a compromised or buggy learner signs what it wants), and an HTTP chunk server
that can flip the bytes of chunks it is told to. The relay is a separate daemon process that pins
the key; what it installs, refuses, counts and serves is read from its /v1/info, its chunk server
and its disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from helpers.swarm import LocalSwarm, http_json, http_status

from echo2swarm.learner.versions import WEIGHTS_FILE, DeltaBase, VersionWriter, delta_file_name
from echo2swarm.policy.delta import encode_delta, tensor_sha256
from echo2swarm.policy.manifest import BaseRef, DeltaFile, Manifest, SignedManifest, sha256_hex
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.wire.signing import PolicyKey

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]
FAST_HEAD = {"ECHO2SWARM_FETCH__HEAD_POLL_S": "0.2", "ECHO2SWARM_FETCH__RETRY_BACKOFF_S": "0.2"}
CHUNK = 64 * 1024



def _until_in(loop: asyncio.AbstractEventLoop, condition: Any, timeout: float, what: str) -> Any:
    """Wait for `condition` while `loop` runs (the in-process learner's chunk server answers only then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        loop.run_until_complete(asyncio.sleep(0.1))
    raise AssertionError(f"timed out waiting for {what}")

def _states(n: int) -> list[dict[str, torch.Tensor]]:
    """n versions of a small bf16 'model': each a few percent of values moved from the one before."""
    g = torch.Generator().manual_seed(0)
    state = {"a.weight": (torch.randn(384, 256, generator=g) * 0.02).bfloat16(),
             "b.bias": (torch.randn(256, generator=g) * 0.02).bfloat16()}
    out = [state]
    for _ in range(n - 1):
        state = {k: (t.float() * (1 + 0.02 * (torch.rand(t.shape, generator=g) < 0.05))).bfloat16()
                 for k, t in state.items()}
        out.append(state)
    return out


class Learner:
    """VersionWriter + stores + a chunk server that flips the chunks in `flip_once` the first time each is asked."""

    def __init__(self, root: Path, key: PolicyKey, swarm: str):
        self.key, self.swarm = key, swarm
        self.chunks, self.versions = ChunkStore(root), VersionStore(root)
        self.flip_once: set[str] = set()
        self.flipped: set[str] = set()
        self.head_answer: bytes | None = None  # what /v1/head answers (at once, whatever it is asked)
        self.head_asked: list[float] = []  # when /v1/head was asked
        self.overlay: Any = None
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, bootstrap: str) -> None:
        from echo2swarm.config.models import OverlayConfig
        from echo2swarm.overlay.node import Overlay

        config = OverlayConfig(swarm=self.swarm, initial_peers=[bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.overlay = await Overlay.start(config)
        self.writer = VersionWriter(self.swarm, self.key, self.chunks, self.versions, CHUNK, self.overlay.peer_id)
        app = web.Application()
        app.router.add_get("/v1/manifest/{version}", self._manifest)
        app.router.add_get("/v1/chunk/{sha256}", self._chunk)
        app.router.add_get("/v1/head", self._head)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()
        if self.overlay:
            await self.overlay.stop()

    async def _manifest(self, request: web.Request) -> web.Response:
        data = self.versions.manifest_bytes(int(request.match_info["version"]))
        return web.Response(body=data) if data is not None else web.Response(status=404)

    async def _head(self, request: web.Request) -> web.Response:
        self.head_asked.append(time.monotonic())
        if self.head_answer is None:
            return web.Response(status=404)
        return web.Response(body=self.head_answer, content_type="application/json")

    async def _chunk(self, request: web.Request) -> web.Response:
        sha = request.match_info["sha256"]
        if not self.chunks.has(sha):
            return web.Response(status=404)
        data = bytearray(self.chunks.get(sha))
        if sha in self.flip_once and sha not in self.flipped:
            self.flipped.add(sha)
            data[len(data) // 2] ^= 0xFF
        return web.Response(body=bytes(data))

    async def announce(self, version: int, manifest_sha256: str, size: int) -> None:
        from echo2swarm.learner.versions import PublishedVersion

        head = self.writer.sign_head(PublishedVersion(version, manifest_sha256, size), ttl_s=60 + version,
                                        chunk_url=self.url)
        assert await self.overlay.store_head(head)

    def publish(self, state: dict[str, torch.Tensor], version: int, previous: DeltaBase | None,
                keyframe: DeltaBase | None) -> DeltaBase:
        published = self.writer.write_state(state, {"config.json": b"{}"}, version, previous=previous,
                                                 keyframe=keyframe, keyframe_every=10, max_ratio=0.9)
        return DeltaBase(version, published.manifest_sha256, state)

    def publish_crafted(self, state: dict[str, torch.Tensor], version: int, delta: tuple[DeltaBase, bytes],
                        alternatives: list[tuple[DeltaBase, bytes]], keyframe: DeltaBase,
                        wrong_hash: bool = False) -> tuple[str, int, list[str]]:
        """A delta manifest signed with the real key, with whatever deltas (and tensor hashes) we say."""
        from safetensors.torch import save

        dense = save(state, metadata={"format": "pt"})
        tensors = [t.model_copy(update={"sha256": tensor_sha256(state[t.name])})
                   for t in self.writer._tensors(WEIGHTS_FILE, dense)]
        if wrong_hash:
            tensors[0] = tensors[0].model_copy(update={"sha256": "0" * 64})

        def entry(base: DeltaBase, blob: bytes) -> DeltaFile:
            return DeltaFile(base=BaseRef(version=base.version, manifest_sha256=base.manifest_sha256),
                             file=self.writer._add_file(delta_file_name(base.version), blob))

        primary = entry(*delta)
        manifest = Manifest(swarm=self.swarm, version=version, created_ms=int(time.time() * 1000), chunk_size=CHUNK,
                            files=[self.writer._add_file("config.json", b"{}")], tensors=tensors, delta=primary,
                            alternatives=[entry(*a) for a in alternatives],
                            keyframe=BaseRef(version=keyframe.version, manifest_sha256=keyframe.manifest_sha256))
        envelope = SignedManifest.sign(manifest, self.key).to_bytes()
        self.versions.install(manifest, envelope, self.chunks, extra={WEIGHTS_FILE: dense})
        return sha256_hex(envelope), len(envelope), [c.sha256 for c in primary.file.chunks]


def _info(daemon: Any) -> dict[str, Any]:
    return http_json(daemon.info["chunk_url"] + "/v1/info")


def _held(daemon: Any) -> list[int]:
    return _info(daemon)["versions"]


def _hashes(path: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    return {k: tensor_sha256(t) for k, t in load_file(str(path)).items()}


def test_tampered_wrong_base_and_wrong_hash_deltas_are_refused_and_never_served(
    local_swarm: LocalSwarm, tmp_path: Path
):
    key = PolicyKey.generate()
    key.save(tmp_path / "learner.key")
    local_swarm.bootstrap()
    assert local_swarm.bootstrap_addr
    relay = local_swarm.start("relay", "--role", "relay", "--trust", f"{tmp_path / 'learner.key'}.pub", env=FAST_HEAD)
    local_swarm.ready(relay)
    states = _states(5)
    learner = Learner(tmp_path / "learner", key, local_swarm.swarm)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(learner.start(local_swarm.bootstrap_addr))

        def until(condition: Any, timeout: float, what: str) -> Any:
            return _until_in(loop, condition, timeout, what)

        def announce(base: DeltaBase) -> None:
            data = learner.versions.manifest_bytes(base.version)
            assert data is not None
            loop.run_until_complete(learner.announce(base.version, sha256_hex(data), len(data)))

        v1 = learner.publish(states[0], 1, None, None)
        announce(v1)
        until(lambda: _held(relay) == [1], 90, "the relay at v1 (keyframe)")

        # v2: an honest delta whose chunks the learner's server flips the first time each is asked.
        v2 = learner.publish(states[1], 2, v1, v1)
        manifest2 = learner.versions.manifest(2)
        assert manifest2 is not None and manifest2.delta is not None
        learner.flip_once = {c.sha256 for c in manifest2.delta.file.chunks}
        announce(v2)
        until(lambda: 2 in _held(relay), 90, "the relay at v2 despite flipped delta chunks")
        info = _info(relay)["stats"]
        assert info["fetch"].get("bad_chunk", 0) >= 1 and learner.flipped, info["fetch"]
        assert info["fetch_path_of"]["2"]["path"] == "delta"
        for path in (relay.state_dir / "chunks").rglob("*"):
            if path.is_file() and not path.name.startswith("."):
                assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name

        # v3: signed, names v2 as its base, but the delta was made against v1 (the wrong base). A
        # correct composite from the keyframe v1 is offered too: the relay refuses the delta and
        # falls back to the keyframe's path.
        sha3, size3, _ = learner.publish_crafted(
            states[2], 3, delta=(v2, encode_delta(states[0], states[2])),
            alternatives=[(v1, encode_delta(states[0], states[2]))], keyframe=v1)
        v3 = DeltaBase(3, sha3, states[2])
        loop.run_until_complete(learner.announce(3, sha3, size3))
        until(lambda: 3 in _held(relay), 90, "the relay at v3 by the keyframe's composite")
        info = _info(relay)["stats"]
        # e2s-delta/2 names each class's size (the base's items of each exponent): a delta made against
        # another base is refused as it is read (wrong_base), or by the tensor hashes where the two bases'
        # exponents match item for item.
        heads_refused = info["refused_heads"]
        assert heads_refused.get("delta_wrong_base", 0) + heads_refused.get("delta_tensor_hash", 0) >= 1, heads_refused
        assert info["fetch_path_of"]["3"]["path"] == "composite", info["fetch_path_of"]
        rebuilt = _hashes(relay.state_dir / "versions" / "v00000003" / WEIGHTS_FILE)
        assert rebuilt == {k: tensor_sha256(t) for k, t in states[2].items()}

        # v4: the learner's key signs a manifest whose tensor hash is wrong: no path rebuilds
        # matching weights, so v4 is refused, never installed, and its delta is not served onward.
        sha4, size4, delta_chunks = learner.publish_crafted(
            states[3], 4, delta=(v3, encode_delta(states[2], states[3])), alternatives=[], keyframe=v1,
            wrong_hash=True)
        refused_before = _info(relay)["stats"]["refused_heads"].get("delta_tensor_hash", 0)
        loop.run_until_complete(learner.announce(4, sha4, size4))
        until(lambda: _info(relay)["stats"]["refused_heads"].get("delta_tensor_hash", 0) > refused_before, 90,
              "the relay to refuse v4")
        until(lambda: _info(relay)["stats"]["fetching_version"] is None, 30, "the relay's fetch of v4 to end")
        assert 4 not in _held(relay) and not (relay.state_dir / "versions" / "v00000004").exists()
        assert http_status(relay.info["chunk_url"] + "/v1/manifest/4")[0] == 404
        for sha in delta_chunks:
            assert http_status(f"{relay.info['chunk_url']}/v1/chunk/{sha}")[0] == 404
        card = json.dumps(_info(relay))
        assert '"fetching_version": 4' not in card

        # Announced again (a freshly signed head for the same bad manifest): the relay sees it, skips it
        # (its own counter of heads refused before, once per signed record) and fetches nothing again.
        def known_bad() -> int:
            return _info(relay)["stats"]["refused_heads"].get("known_bad", 0)

        seen = until(known_bad, 30, "the relay to skip v4's head when it reads it again")
        fetched = _info(relay)["stats"]["fetch"].get("bytes_fetched", 0)
        time.sleep(0.002)  # the new head's published_ms differs from the last one's
        loop.run_until_complete(learner.announce(4, sha4, size4))
        until(lambda: known_bad() > seen, 30, "the relay to skip the re-announced v4")
        info = _info(relay)
        assert max(info["versions"]) == 3 and info["stats"]["fetching_version"] is None
        assert info["stats"]["fetch"].get("bytes_fetched", 0) == fetched  # not one byte of v4 again
        assert not (relay.state_dir / "versions" / "v00000004").exists()
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(relay.info["http_url"] + "/metrics", timeout=10) as resp:
            samples = {(s.name, s.labels.get("reason")): s.value
                       for f in text_string_to_metric_families(resp.read().decode()) for s in f.samples}
        assert samples[("echo2swarm_policy_heads_refused_total", "known_bad")] >= seen + 1  # in metrics too
    finally:
        loop.run_until_complete(learner.stop())
        pending = asyncio.all_tasks(loop)  # hivemind leaves store/ping tasks behind
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


def test_a_lying_head_long_poll_is_only_a_hint_and_asked_at_the_dht_pace(local_swarm: LocalSwarm, tmp_path: Path):
    """The relay long-polls /v1/head at the chunk URL of the learner's signed head. A server there that
    answers at once with a forged head (another key's, for a far newer version), an oversized body or
    junk gets it counted and refused, never fetched, and is asked at most about once per head_poll_s."""
    key, other = PolicyKey.generate(), PolicyKey.generate()
    key.save(tmp_path / "learner.key")
    local_swarm.bootstrap()
    assert local_swarm.bootstrap_addr
    relay = local_swarm.start("relay", "--role", "relay", "--trust", f"{tmp_path / 'learner.key'}.pub", env=FAST_HEAD)
    local_swarm.ready(relay)
    learner = Learner(tmp_path / "learner", key, local_swarm.swarm)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(learner.start(local_swarm.bootstrap_addr))

        def until(condition: Any, timeout: float, what: str) -> Any:
            return _until_in(loop, condition, timeout, what)

        v1 = learner.publish(_states(1)[0], 1, None, None)
        data = learner.versions.manifest_bytes(1)
        assert data is not None
        loop.run_until_complete(learner.announce(1, sha256_hex(data), len(data)))
        until(lambda: _held(relay) == [1], 90, "the relay at v1")
        assert v1.version == 1

        # A head for v9 signed by another key, answered at once to every long-poll.
        from echo2swarm.learner.versions import PublishedVersion

        forged = VersionWriter(local_swarm.swarm, other, learner.chunks, learner.versions, CHUNK, learner.overlay.peer_id)
        learner.head_answer = forged.sign_head(PublishedVersion(9, "ab" * 32, 1000), ttl_s=60,
                                               chunk_url=learner.url).model_dump_json().encode()
        until(lambda: _info(relay)["stats"]["refused_heads"].get("untrusted_key", 0) >= 1, 30,
              "the relay to refuse the forged long-polled head")
        asked = len(learner.head_asked)
        until(lambda: len(learner.head_asked) >= asked + 5, 30, "five more long-polls")
        spread = learner.head_asked[asked + 4] - learner.head_asked[asked]
        assert spread >= 4 * 0.2 * 0.7, f"5 long-polls within {spread:.2f} s: answered early, they must wait head_poll_s"

        # An oversized answer and junk: ignored or counted malformed, nothing fetched, still paced.
        learner.head_answer = b'{"pad": "' + b"x" * (20 * 1024) + b'"}'
        asked = len(learner.head_asked)
        until(lambda: len(learner.head_asked) >= asked + 3, 30, "long-polls answered with 20 KiB")
        malformed = _info(relay)["stats"]["refused_heads"].get("malformed", 0)
        learner.head_answer = b"not json"
        until(lambda: _info(relay)["stats"]["refused_heads"].get("malformed", 0) > malformed, 30,
              "the junk answer counted malformed")
        info = _info(relay)
        assert info["versions"] == [1] and info["stats"]["fetching_version"] is None
        assert "9" not in info["stats"]["fetch_path_of"] and info["stats"]["fetch"].get("manifest_bad_signature", 0) == 0
    finally:
        loop.run_until_complete(learner.stop())
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
