"""The daemon's libp2p identity: the key p2pd runs with is the key that signs our card (overlay/node.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay.node import BootstrapError, _identity
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
