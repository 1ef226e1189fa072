"""Untrusted peers: forged records, garbage RPC and HTTP, rogue learners, stale versions.

The hostile peer here is a raw hivemind node with no record validator, so it sends exactly the
bytes it wants; the honest daemons must refuse them, count them, and keep serving.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest
from helpers.swarm import LocalSwarm, SwarmWatcher, http_json, http_status, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def _synced(swarm: LocalSwarm, model: Path, key: Path) -> tuple:
    """A learner and a relay that follows it. A relay generates nothing, so the learner stays at v1
    and every version change in these tests comes from what the test does."""
    swarm.bootstrap()
    learner = swarm.learner(model, key)
    relay = swarm.start("relay", "--role", "relay", "--trust", f"{key}.pub")
    swarm.ready(learner)
    swarm.ready(relay)
    wait_until(lambda: http_json(relay.info["chunk_url"] + "/v1/info")["version"] == 1, 60, what="relay at v1")
    return learner, relay


async def _hostile_peer(bootstrap: str, swarm: str, learner_peer_id: str) -> dict:
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.timed_storage import get_dht_time

    from echo2swarm.overlay.dht_keys import head_key, peers_key

    p2p = await P2P.create(initial_peers=[bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    node = await DHTNode.create(p2p=p2p, initial_peers=[bootstrap], record_validator=None)
    outcome: dict = {}
    try:
        found = await node.get(head_key(swarm), latest=True)
        subkey, item = next(iter(found.value.items()))
        forged = dict(item.value, version=99)  # signature no longer covers the fields
        expiry = get_dht_time() + 60
        await node.store(head_key(swarm), forged, expiry, subkey=subkey)
        await node.store(peers_key(swarm), {"peer_id": "evil", "role": "learner"}, expiry, subkey="evil")
        await node.store(peers_key(swarm), {"blob": "x" * 20_000}, expiry, subkey="big")
        target = PeerID.from_base58(learner_peer_id)
        for payload in (os.urandom(1000), os.urandom(5 * 1024 * 1024)):
            try:
                await asyncio.wait_for(p2p._client.call_unary_handler(target, "DHTProtocol.rpc_store", payload), 10)
                outcome.setdefault("rpc_accepted", 0)
                outcome["rpc_accepted"] += 1
            except Exception as e:  # the daemon must refuse; how it refuses is hivemind's business
                outcome.setdefault("rpc_refused", []).append(type(e).__name__)
    finally:
        await node.shutdown()
        await p2p.shutdown()
    return outcome


@pytest.fixture(scope="module")
def synced(module_swarm: LocalSwarm, tiny_model_dir: Path, module_policy_key: Path) -> tuple:
    """The learner and relay the first two tests share: they leave both serving v1, as they found them.
    (The rogue learner's head outlives its test: the forged-records test, which counts heads, runs first.)"""
    return _synced(module_swarm, tiny_model_dir, module_policy_key)


def test_forged_records_and_garbage_are_refused_while_daemons_keep_serving(module_swarm: LocalSwarm, synced: tuple):
    learner, relay = synced
    local_swarm = module_swarm
    assert local_swarm.bootstrap_addr
    outcome = asyncio.run(_hostile_peer(local_swarm.bootstrap_addr, local_swarm.swarm, learner.info["peer_id"]))
    assert len(outcome.get("rpc_refused", [])) == 2, outcome

    # Honest nodes refused the forged records; readers never see them.
    wait_until(lambda: http_json(learner.info["chunk_url"] + "/v1/info")["stats"]["dht_refused"] >= 3, 15,
               what="the learner to count refused records")
    with SwarmWatcher(local_swarm.bootstrap_addr, local_swarm.swarm) as watcher:
        view = watcher.census()
    assert {p["peer_id"] for p in view["peers"]} == {d.info["peer_id"] for d in local_swarm.daemons}
    assert [h["version"] for h in view["heads"]] == [1]

    # Garbage HTTP: every request refused with the right status, nothing crashes.
    url = learner.info["chunk_url"]
    assert http_status(url + "/v1/chunk/not-a-hash")[0] == 400
    assert http_status(url + "/v1/chunk/" + "ab" * 32)[0] == 404
    assert http_status(url + "/v1/manifest/abc")[0] == 400
    assert http_status(url + "/v1/manifest/7")[0] == 404
    assert http_status(url + "/v1/chunk/" + "ab" * 32, method="POST", data=b"")[0] == 405
    assert http_status(url + "/v1/chunk/" + "ab" * 32, method="POST", data=b"x")[0] == 413
    assert http_status(url + "/v1/info", data=b"x" * 4096, method="GET")[0] == 413
    assert http_status(url + "/v1/info", headers={"X-Big": "y" * 100_000})[0] in (400, 431)
    assert http_status(url + "/nope")[0] == 404
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(os.urandom(4096) + b"\r\n\r\n")
        s.settimeout(5)
        reply = s.recv(100)
    assert reply == b"" or (reply.startswith(b"HTTP/1.") and b" 400 " in reply[:20])

    # Both daemons are alive and still serve the policy and their cards.
    info = http_json(url + "/v1/info")
    assert info["version"] == 1 and info["stats"]["server"]["refused_400"] >= 2
    assert http_json(relay.info["chunk_url"] + "/v1/info")["version"] == 1
    assert learner.running() and relay.running()


def test_rogue_learner_with_another_key_is_ignored_by_pinned_peers(
    joined_swarm: LocalSwarm, synced: tuple, tiny_model_dir: Path, module_policy_key: Path, tmp_path: Path
):
    from echo2swarm.wire.signing import PolicyKey

    policy_key = module_policy_key
    learner, relay = synced
    rogue_key = tmp_path / "rogue.key"
    PolicyKey.generate().save(rogue_key)
    rogue = joined_swarm.learner(tiny_model_dir, rogue_key, name="rogue")
    joined_swarm.ready(rogue)
    info_url = relay.info["chunk_url"] + "/v1/info"
    wait_until(lambda: http_json(info_url)["stats"]["refused_heads"].get("untrusted_key", 0) >= 1, 60,
               what="the relay to refuse the rogue head")
    info = http_json(info_url)
    assert info["version"] == 1
    assert info["stats"]["trusted_key"] == Path(f"{policy_key}.pub").read_text().strip()
    assert "refused policy head" in relay.log_path.read_text()
    assert relay.running()


def test_restarted_learner_goes_up_and_a_lower_version_is_refused(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path
):
    learner, relay = _synced(local_swarm, tiny_model_dir, policy_key)
    info_url = relay.info["chunk_url"] + "/v1/info"
    learner.terminate()
    # Same state dir: the learner resumes with a strictly higher version; the peer follows without restarting.
    again = local_swarm.learner(tiny_model_dir, policy_key, name="learner", state_dir=learner.state_dir)
    local_swarm.ready(again)
    wait_until(lambda: http_json(info_url)["version"] == 2, 60, what="the relay at v2")
    again.terminate()
    # A learner that lost its state publishes v1 again: refused as stale, the peer keeps v2 and keeps serving.
    amnesiac = local_swarm.learner(tiny_model_dir, policy_key, name="amnesiac")
    local_swarm.ready(amnesiac)
    wait_until(lambda: http_json(info_url)["stats"]["refused_heads"].get("stale_version", 0) >= 1, 60,
               what="the stale head to be refused")
    assert http_json(info_url)["version"] == 2
    assert relay.running()
