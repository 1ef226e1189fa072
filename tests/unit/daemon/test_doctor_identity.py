"""`echo2swarm doctor`'s identity check reads the --identity file as the daemon does (daemon/doctor.py)."""

from __future__ import annotations

from pathlib import Path

from echo2swarm.config.models import RolloutConfig
from echo2swarm.daemon.doctor import check_identity
from echo2swarm.wire.peer_keys import PeerKey
from echo2swarm.wire.signing import PolicyKey


def _check(identity: Path | None):
    return check_identity(RolloutConfig.model_validate({"overlay": {"new_swarm": True, "identity": identity}}))


def test_rsa_and_ed25519_identity_files_are_both_fine(tmp_path: Path) -> None:
    from hivemind.p2p import P2P

    rsa, ed = tmp_path / "rsa.id", tmp_path / "ed.id"
    P2P.generate_identity(str(rsa))
    PeerKey.generate().save(ed)
    check = _check(rsa)
    assert check.status == "ok" and "RSA-2048 key" in check.detail and PeerKey.load(rsa).peer_id in check.detail
    check = _check(ed)
    assert check.status == "ok" and "Ed25519 key" in check.detail
    assert _check(tmp_path / "new.id").status == "ok" and not (tmp_path / "new.id").exists()
    assert _check(None).status == "ok"


def test_a_policy_key_or_another_key_type_fails_with_what_to_do(tmp_path: Path) -> None:
    pem = tmp_path / "learner.key"
    PolicyKey.generate().save(pem)
    check = _check(pem)
    assert check.status == "fail" and "PEM file" in check.detail and "echo2swarm keygen" in check.detail
    assert "move" in check.fix and "Ed25519" in check.fix
    secp = tmp_path / "secp.id"
    secp.write_bytes(b"\x08\x02\x12\x01x")  # key type 2, Secp256k1
    check = _check(secp)
    assert check.status == "fail" and "key type 2 is not supported" in check.detail
