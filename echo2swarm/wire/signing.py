"""Ed25519 policy keys and domain-separated signatures over canonical JSON.

Canonical bytes: JSON with sorted keys, no whitespace, UTF-8, integers only (no floats, so every
language serialises the same bytes). Each signed object type has its own domain prefix, so a
signature over a head record can never be replayed as a signature over a manifest.

Key files: the private key is PKCS#8 PEM (mode 0600); the public key is one line,
`ed25519:<64 hex chars>`, which is also what `--trust` accepts inline.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_PREFIX = "ed25519:"
DOMAIN_MANIFEST = b"echo2swarm/manifest/v1\n"
DOMAIN_HEAD = b"echo2swarm/head/v1\n"
DOMAIN_PLAN = b"echo2swarm/plan/v1\n"
DOMAIN_CARD = b"echo2swarm/card/v1\n"  # signed by the libp2p key of the card's peer id (wire/peer_keys.py)


class KeyFileError(ValueError):
    """A key file or key string that cannot be used; the message says which and why."""


def canonical_bytes(obj: Any) -> bytes:
    def no_floats(value: Any) -> Any:
        if isinstance(value, float):
            raise TypeError("canonical JSON carries no floats; use integers (e.g. milliseconds)")
        if isinstance(value, dict):
            return {k: no_floats(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [no_floats(v) for v in value]
        return value

    return json.dumps(no_floats(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def float_text(value: float) -> str:
    """How a float is written inside signed canonical JSON: its IEEE-754 binary64 bits.

    "f64:" then 16 lowercase hex digits, big-endian; exact, and the same in every language
    (decimal forms of floats differ between JSON libraries).

    >>> float_text(0.5)
    'f64:3fe0000000000000'
    """
    return "f64:" + struct.pack(">d", value).hex()


@dataclass(frozen=True)
class PublicKey:
    raw: bytes

    @classmethod
    def parse(cls, text: str) -> "PublicKey":
        text = text.strip()
        if not text.startswith(PUBLIC_PREFIX):
            raise KeyFileError(f"a policy public key looks like '{PUBLIC_PREFIX}<64 hex chars>', got {text[:40]!r}")
        body = text[len(PUBLIC_PREFIX):]
        try:
            raw = bytes.fromhex(body)
        except ValueError:
            raise KeyFileError("the policy public key is not hex after 'ed25519:'") from None
        if len(raw) != 32:
            raise KeyFileError(f"an Ed25519 public key is 32 bytes (64 hex chars), got {len(raw)} bytes")
        return cls(raw)

    @property
    def text(self) -> str:
        return PUBLIC_PREFIX + self.raw.hex()

    @property
    def fingerprint(self) -> str:
        """Short form for logs and tables."""
        return self.raw.hex()[:16]

    def verify(self, domain: bytes, message: bytes, signature: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, domain + message)
            return True
        except (InvalidSignature, ValueError):
            return False


class PolicyKey:
    """The learner's signing key.

    >>> key = PolicyKey.generate()
    >>> sig = key.sign(DOMAIN_HEAD, b"payload")
    >>> key.public.verify(DOMAIN_HEAD, b"payload", sig)
    True
    """

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public = PublicKey(raw)

    @classmethod
    def generate(cls) -> "PolicyKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: Path) -> "PolicyKey":
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            raise KeyFileError(f"policy key {path} does not exist; create it with `echo2swarm keygen {path}`") from None
        try:
            private = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise KeyFileError(f"policy key {path} is not an unencrypted PEM private key: {e}") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise KeyFileError(f"policy key {path} is not an Ed25519 key")
        return cls(private)

    def save(self, path: Path, *, overwrite: bool = False) -> Path:
        """Write PATH (private, mode 0600) and PATH.pub (public key line). Returns the .pub path."""
        path = Path(path)
        pub_path = path.with_name(path.name + ".pub")
        if not overwrite and (path.exists() or pub_path.exists()):
            raise FileExistsError(f"{path} or {pub_path} already exists; refusing to overwrite a policy key")
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply when overwriting an existing file
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        pub_path.write_text(self.public.text + "\n")
        return pub_path

    def sign(self, domain: bytes, message: bytes) -> bytes:
        return self._private.sign(domain + message)


def load_trusted_key(spec: str) -> PublicKey:
    """`--trust` value: an inline 'ed25519:<hex>' key or a path to a KEY.pub file."""
    spec = spec.strip()
    if spec.startswith(PUBLIC_PREFIX):
        try:
            return PublicKey.parse(spec)
        except KeyFileError as e:
            raise KeyFileError(f"--trust {spec[:40]!r}: {e}") from None
    path = Path(spec).expanduser()
    if not path.is_file():
        raise KeyFileError(f"--trust {spec!r}: no such key file (pass the learner's KEY.pub or 'ed25519:<hex>')")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"--trust {spec!r}: cannot read the key file: {e}") from None
    try:
        return PublicKey.parse(text)
    except KeyFileError as e:
        raise KeyFileError(f"--trust {spec!r}: {e}") from None
