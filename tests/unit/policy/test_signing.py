"""Ed25519 policy keys, key files, `--trust` parsing and domain-separated signatures."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from echo2swarm.wire.signing import (
    DOMAIN_HEAD,
    DOMAIN_MANIFEST,
    KeyFileError,
    PolicyKey,
    PublicKey,
    canonical_bytes,
    load_trusted_key,
)


@pytest.fixture(scope="module")
def key() -> PolicyKey:
    return PolicyKey.generate()


def test_save_and_load_round_trip(tmp_path: Path, key: PolicyKey) -> None:
    path = tmp_path / "keys" / "learner.key"

    pub_path = key.save(path)

    assert pub_path == tmp_path / "keys" / "learner.key.pub"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    line = pub_path.read_text()
    assert line.endswith("\n") and line.count("\n") == 1
    prefix, hexbody = line.strip().split(":")
    assert prefix == "ed25519"
    assert len(hexbody) == 64 and int(hexbody, 16) >= 0 and hexbody == hexbody.lower()

    loaded = PolicyKey.load(path)
    assert loaded.public == key.public
    sig = loaded.sign(DOMAIN_HEAD, b"payload")
    assert key.public.verify(DOMAIN_HEAD, b"payload", sig)
    assert load_trusted_key(str(pub_path)) == key.public


def test_save_refuses_to_overwrite(tmp_path: Path, key: PolicyKey) -> None:
    path = tmp_path / "learner.key"
    key.save(path)
    before = path.read_bytes()
    other = PolicyKey.generate()

    with pytest.raises(FileExistsError):
        other.save(path)
    assert path.read_bytes() == before

    other.save(path, overwrite=True)
    assert PolicyKey.load(path).public == other.public
    assert load_trusted_key(str(tmp_path / "learner.key.pub")) == other.public


def test_save_refuses_when_only_the_pub_file_exists(tmp_path: Path, key: PolicyKey) -> None:
    (tmp_path / "learner.key.pub").write_text("ed25519:" + "00" * 32 + "\n")
    with pytest.raises(FileExistsError):
        key.save(tmp_path / "learner.key")
    assert not (tmp_path / "learner.key").exists()


def test_load_missing_or_garbage_private_key(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="keygen"):
        PolicyKey.load(tmp_path / "missing.key")
    (tmp_path / "bad.key").write_text("not pem")
    with pytest.raises(KeyFileError, match="PEM"):
        PolicyKey.load(tmp_path / "bad.key")


def test_load_trusted_key_inline(key: PolicyKey) -> None:
    assert load_trusted_key(key.public.text) == key.public
    assert load_trusted_key(f"  {key.public.text}\n") == key.public


def test_load_trusted_key_from_path(tmp_path: Path, key: PolicyKey) -> None:
    pub = tmp_path / "learner.key.pub"
    pub.write_text(key.public.text + "\n")
    assert load_trusted_key(str(pub)) == key.public


def test_load_trusted_key_missing_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="--trust"):
        load_trusted_key(str(tmp_path / "nope.pub"))


@pytest.mark.parametrize(
    "content",
    [
        "rsa:" + "ab" * 32,  # wrong prefix
        "ed25519:" + "zz" * 32,  # not hex
        "ed25519:" + "ab" * 31,  # 31 bytes
        "ed25519:" + "ab" * 33,  # 33 bytes
        "",
    ],
)
def test_load_trusted_key_malformed_file(tmp_path: Path, content: str) -> None:
    pub = tmp_path / "bad.pub"
    pub.write_text(content)
    with pytest.raises(KeyFileError, match="--trust"):
        load_trusted_key(str(pub))


@pytest.mark.parametrize("spec", ["ed25519:" + "zz" * 32, "ed25519:" + "ab" * 31])
def test_load_trusted_key_malformed_inline_is_refused(spec: str) -> None:
    with pytest.raises(KeyFileError):
        load_trusted_key(spec)


@pytest.mark.parametrize("spec", ["ed25519:" + "zz" * 32, "ed25519:" + "ab" * 31])
def test_load_trusted_key_malformed_inline_names_the_flag(spec: str) -> None:
    with pytest.raises(KeyFileError, match="--trust"):
        load_trusted_key(spec)


def test_public_key_parse_and_text(key: PolicyKey) -> None:
    assert PublicKey.parse(key.public.text).text == key.public.text
    assert key.public.fingerprint == key.public.text.removeprefix("ed25519:")[:16]


def test_signature_verifies_only_the_exact_message_and_domain(key: PolicyKey) -> None:
    message = canonical_bytes({"version": 3, "swarm": "demo"})
    sig = key.sign(DOMAIN_HEAD, message)

    assert key.public.verify(DOMAIN_HEAD, message, sig)
    assert not key.public.verify(DOMAIN_HEAD, message + b" ", sig)
    assert not key.public.verify(DOMAIN_HEAD, canonical_bytes({"version": 4, "swarm": "demo"}), sig)
    # Domain separation: a head signature is never a manifest signature.
    assert not key.public.verify(DOMAIN_MANIFEST, message, sig)
    assert not key.public.verify(DOMAIN_HEAD, message, sig[:-1])
    assert not PolicyKey.generate().public.verify(DOMAIN_HEAD, message, sig)


@pytest.mark.parametrize("index", [0, 31, 63])
def test_one_flipped_signature_byte_fails(key: PolicyKey, index: int) -> None:
    sig = bytearray(key.sign(DOMAIN_MANIFEST, b"m"))
    sig[index] ^= 0x01
    assert not key.public.verify(DOMAIN_MANIFEST, b"m", bytes(sig))


def test_canonical_bytes_is_key_order_independent() -> None:
    a = canonical_bytes({"b": 1, "a": {"y": [1, 2], "x": "é"}})
    b = canonical_bytes({"a": {"x": "é", "y": [1, 2]}, "b": 1})
    assert a == b
    assert a == '{"a":{"x":"é","y":[1,2]},"b":1}'.encode()


@pytest.mark.parametrize("obj", [1.5, {"a": 0.0}, {"a": [1, {"b": float("nan")}]}, (1, 2.0)])
def test_canonical_bytes_refuses_floats(obj: object) -> None:
    with pytest.raises(TypeError, match="floats"):
        canonical_bytes(obj)


def test_overwritten_private_key_is_mode_0600(tmp_path: Path, key: PolicyKey) -> None:
    path = tmp_path / "learner.key"
    path.write_text("old")
    path.chmod(0o644)
    key.save(path, overwrite=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
