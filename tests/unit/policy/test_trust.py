"""Which learner key a follower trusts: pinned, or trust on first use (echo2swarm/policy/trust.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo2swarm.wire.records import HeadRecord
from echo2swarm.wire.signing import KeyFileError, PolicyKey
from echo2swarm.policy.trust import TOFU_FILE, TrustAnchor

SWARM = "demo"
PEER_ID = "12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"


@pytest.fixture(scope="module")
def learner() -> PolicyKey:
    return PolicyKey.generate()


@pytest.fixture(scope="module")
def intruder() -> PolicyKey:
    return PolicyKey.generate()


def head(key: PolicyKey, version: int, swarm: str = SWARM) -> HeadRecord:
    return HeadRecord(
        swarm=swarm, version=version, manifest_sha256="ab" * 32, manifest_size=100,
        publisher=PEER_ID, published_ms=0, expires_ms=30_000, public_key=key.public.text,
    ).signed(key)


def forged(key: PolicyKey, version: int) -> HeadRecord:
    """A head claiming `key` whose signature does not match its content."""
    return head(key, version).model_copy(update={"version": version + 1000})


def test_pinned_key_selects_its_newest_head(tmp_path: Path, learner: PolicyKey, intruder: PolicyKey) -> None:
    anchor = TrustAnchor(tmp_path, pinned=learner.public)
    heads = [head(learner, 3), head(intruder, 50), head(learner, 5), head(learner, 4)]

    chosen = anchor.select(heads, SWARM)

    assert chosen is not None and chosen.version == 5 and chosen.public_key == learner.public.text
    assert anchor.key == learner.public
    assert anchor.source == "--trust"
    assert not (tmp_path / TOFU_FILE).exists()


def test_pinned_key_ignores_other_signers_only(tmp_path: Path, learner: PolicyKey, intruder: PolicyKey) -> None:
    anchor = TrustAnchor(tmp_path, pinned=learner.public)
    assert anchor.select([head(intruder, 9)], SWARM) is None
    assert anchor.select([], SWARM) is None


def test_pinned_key_ignores_forged_heads_claiming_it(tmp_path: Path, learner: PolicyKey) -> None:
    anchor = TrustAnchor(tmp_path, pinned=learner.public)
    chosen = anchor.select([head(learner, 3), forged(learner, 4), head(learner, 9, swarm="other")], SWARM)
    assert chosen is not None and chosen.version == 3


def test_tofu_pins_the_only_signer_and_stores_it(tmp_path: Path, learner: PolicyKey) -> None:
    state = tmp_path / "state"
    anchor = TrustAnchor(state, pinned=None)
    assert anchor.key is None

    chosen = anchor.select([head(learner, 1), head(learner, 2)], SWARM)

    assert chosen is not None and chosen.version == 2
    assert anchor.key == learner.public
    assert (state / TOFU_FILE).read_text() == learner.public.text + "\n"

    again = TrustAnchor(state, pinned=None)
    assert again.key == learner.public
    assert TOFU_FILE in again.source


def test_stored_key_is_used_and_other_signers_are_ignored(tmp_path: Path, learner: PolicyKey, intruder: PolicyKey) -> None:
    TrustAnchor(tmp_path, pinned=None).select([head(learner, 1)], SWARM)

    anchor = TrustAnchor(tmp_path, pinned=None)
    chosen = anchor.select([head(intruder, 10), head(learner, 2)], SWARM)

    assert chosen is not None and chosen.public_key == learner.public.text and chosen.version == 2
    assert anchor.select([head(intruder, 10)], SWARM) is None


def test_pinned_key_overrides_stored_key(tmp_path: Path, learner: PolicyKey, intruder: PolicyKey) -> None:
    TrustAnchor(tmp_path, pinned=None).select([head(intruder, 1)], SWARM)
    anchor = TrustAnchor(tmp_path, pinned=learner.public)
    assert anchor.key == learner.public
    assert anchor.select([head(intruder, 3), head(learner, 2)], SWARM).version == 2  # type: ignore[union-attr]


def test_tofu_with_two_signers_refuses_to_guess(tmp_path: Path, learner: PolicyKey, intruder: PolicyKey) -> None:
    anchor = TrustAnchor(tmp_path, pinned=None)
    assert anchor.select([head(learner, 1), head(intruder, 1)], SWARM) is None
    assert anchor.select([head(learner, 1), head(intruder, 1)], SWARM) is None  # warned once, still refuses
    assert anchor.key is None
    assert not (tmp_path / TOFU_FILE).exists()


def test_tofu_ignores_heads_with_a_bad_signature(tmp_path: Path, learner: PolicyKey, intruder: PolicyKey) -> None:
    anchor = TrustAnchor(tmp_path, pinned=None)

    # Only the learner signs correctly: the intruder's forged head does not make it ambiguous.
    chosen = anchor.select([head(learner, 1), forged(intruder, 1)], SWARM)
    assert chosen is not None and anchor.key == learner.public


def test_tofu_with_only_bad_signatures_pins_nothing(tmp_path: Path, intruder: PolicyKey) -> None:
    anchor = TrustAnchor(tmp_path, pinned=None)
    assert anchor.select([forged(intruder, 1)], SWARM) is None
    assert anchor.key is None
    assert not (tmp_path / TOFU_FILE).exists()


def test_tofu_ignores_heads_of_other_swarms(tmp_path: Path, learner: PolicyKey, intruder: PolicyKey) -> None:
    anchor = TrustAnchor(tmp_path, pinned=None)
    assert anchor.select([head(intruder, 1, swarm="other")], SWARM) is None
    chosen = anchor.select([head(learner, 1), head(intruder, 1, swarm="other")], SWARM)
    assert chosen is not None and anchor.key == learner.public


@pytest.mark.parametrize("content", ["garbage", "ed25519:" + "zz" * 32, "ed25519:abcd", ""])
def test_corrupt_stored_key_is_an_error(tmp_path: Path, content: str) -> None:
    (tmp_path / TOFU_FILE).write_text(content)
    with pytest.raises(KeyFileError, match="--trust"):
        TrustAnchor(tmp_path, pinned=None)
