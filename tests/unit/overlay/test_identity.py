"""The daemon's libp2p identity: the key p2pd runs with is the key that signs our card (overlay/node.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay.node import BootstrapError, Overlay, _identity
from echo2swarm.wire.peer_keys import PeerKey


def test_without_identity_a_fresh_key_per_start_in_a_private_temp_file(tmp_path: Path) -> None:
    (tmp_path / ".identity-stale.key").write_bytes(b"left by a killed start")
    config = OverlayConfig(new_swarm=True)
    key, path, temporary = _identity(config, tmp_path)
    assert temporary and path.parent == tmp_path and path.stat().st_mode & 0o077 == 0
    assert PeerKey.load(path).peer_id == key.peer_id and key.is_ed25519
    assert not (tmp_path / ".identity-stale.key").exists()
    other, _, _ = _identity(config, tmp_path)
    assert other.peer_id != key.peer_id


def test_identity_file_is_created_once_then_reused(tmp_path: Path) -> None:
    config = OverlayConfig(new_swarm=True, identity=tmp_path / "ids" / "peer.key")
    key, path, temporary = _identity(config, None)
    assert not temporary and path == config.identity and path.is_file()
    again, _, _ = _identity(config, None)
    assert again.peer_id == key.peer_id


def test_an_unusable_identity_file_is_a_bootstrap_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"\x08\x02\x12\x01x")  # a Secp256k1 key type: not supported
    with pytest.raises(BootstrapError, match="--identity"):
        _identity(OverlayConfig(new_swarm=True, identity=junk), None)


@pytest.mark.parametrize("kind", ["rsa", "ed25519"])
def test_every_p2pd_started_for_an_identity_file_gets_the_relays_its_auto_relay_needs(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """p2pd panics ("autoRelay requires either -relayDiscovery=1 or -trustedRelays") when started with
    -autoRelay and -relayDiscovery=0 but no -trustedRelays. hivemind's is-this-identity-taken probe, run
    for RSA files only, started such a second p2pd through our class: an RSA identity never started.
    Here no p2pd runs: the spawns are recorded, and the first one is refused."""
    import asyncio

    import hivemind.p2p.p2p_daemon as p2p_daemon
    from hivemind.p2p import P2P

    identity = tmp_path / "id.key"
    P2P.generate_identity(str(identity)) if kind == "rsa" else PeerKey.generate().save(identity)
    spawned: list[list[str]] = []

    async def spawn(*args: str, **_: object) -> None:
        spawned.append(list(args))
        raise OSError("recorded, not started")

    monkeypatch.setattr(p2p_daemon.asyncio.subprocess, "create_subprocess_exec", spawn)
    boot = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWKQrSSn5ZBwDccNX4YGqqQN5Ec7VERMJ6BxpqRcx8aUvD"
    config = OverlayConfig(initial_peers=[boot], identity=identity, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    assert config.use_auto_relay  # the default
    with pytest.raises(BootstrapError, match="p2pd did not start: .*recorded, not started"):
        asyncio.run(Overlay.start(config))
    assert len(spawned) == 1, "one p2pd per start: no second one to probe the identity"
    flags = {arg.split("=", 1)[0]: arg.partition("=")[2] for arg in spawned[0][1:]}
    assert flags["-autoRelay"] == "1" and flags["-relayDiscovery"] == "0"
    assert flags["-trustedRelays"] == boot and flags["-id"] == str(identity)
