"""libp2p identity keys: peer ids, the key file p2pd loads, and signatures by a peer id's owner.

Pure encoding, no hivemind: the overlay loads the same file p2pd does and signs our peer card
with it; every node checks such a signature against the peer id the card is stored under.

Facts from the libp2p peer-id spec (and go-libp2p, which p2pd is built on):

    PublicKey / PrivateKey   protobuf { 1: KeyType key_type (varint), 2: bytes data }
                             KeyType: RSA = 0, Ed25519 = 1 (Secp256k1 = 2, ECDSA = 3: not accepted here)
    Ed25519 data             public: the 32 raw bytes; private: 32-byte seed ‖ 32-byte public key
    RSA data                 public: DER SubjectPublicKeyInfo; private: DER PKCS#1 (what hivemind writes)
    peer id bytes            multihash of the serialised PublicKey: "identity" (code 0x00) when that
                             serialisation is at most 42 bytes (every Ed25519 key: the key is inside
                             the id), else sha2-256 (code 0x12, 32-byte digest; RSA keys)
    text form                base58btc (bitcoin alphabet) of those bytes: "12D3KooW..." for Ed25519

Signatures: Ed25519 (RFC 8032) for Ed25519 keys; RSASSA-PKCS1-v1_5 with SHA-256 for RSA keys
(libp2p's RSA scheme). What is signed is always `domain ‖ message` (see wire/signing.py).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_RSA, KEY_ED25519 = 0, 1
_MH_IDENTITY, _MH_SHA256 = 0x00, 0x12
_MAX_INLINE_KEY = 42  # serialised public keys up to this size are embedded in the peer id
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}
_PEER_ID_TEXT = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")
MAX_PUBLIC_KEY_BYTES = 1024  # a serialised RSA-4096 public key is ~550 bytes
MIN_RSA_BITS = 2048


class PeerKeyError(ValueError):
    """A key, key file or peer id that cannot be used; the message says why."""


# -- base58btc -----------------------------------------------------------------------------------
def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * zeros + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    n = 0
    for c in text:
        if c not in _B58_INDEX:
            raise PeerKeyError(f"not base58: {c!r}")
        n = n * 58 + _B58_INDEX[c]
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    zeros = len(text) - len(text.lstrip("1"))
    return b"\0" * zeros + body


# -- protobuf (two fields, so written by hand) ---------------------------------------------------
def varint(n: int) -> bytes:
    """Unsigned LEB128, as protobuf, multihash and multiaddr write their lengths and codes."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise PeerKeyError("truncated varint")
        byte = data[pos]
        pos += 1
        n |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return n, pos


def encode_key_proto(key_type: int, data: bytes) -> bytes:
    """The libp2p PublicKey/PrivateKey message: field 1 (varint) then field 2 (bytes)."""
    return b"\x08" + varint(key_type) + b"\x12" + varint(len(data)) + data


def decode_key_proto(blob: bytes) -> tuple[int, bytes]:
    key_type: int | None = None
    data: bytes | None = None
    pos = 0
    while pos < len(blob):
        tag, pos = _read_varint(blob, pos)
        if tag == 0x08:
            key_type, pos = _read_varint(blob, pos)
        elif tag == 0x12:
            size, pos = _read_varint(blob, pos)
            if pos + size > len(blob):
                raise PeerKeyError("truncated key bytes")
            data, pos = blob[pos:pos + size], pos + size
        else:
            raise PeerKeyError(f"unexpected protobuf field tag {tag} in a libp2p key")
    if key_type is None or data is None:
        raise PeerKeyError("a libp2p key needs both key_type and data")
    return key_type, data


# -- peer ids ------------------------------------------------------------------------------------
def peer_id_bytes(public_proto: bytes) -> bytes:
    if len(public_proto) <= _MAX_INLINE_KEY:
        return bytes([_MH_IDENTITY]) + varint(len(public_proto)) + public_proto
    return bytes([_MH_SHA256, 32]) + hashlib.sha256(public_proto).digest()


def peer_id_of(public_proto: bytes) -> str:
    """The base58 peer id of a serialised libp2p public key."""
    return b58encode(peer_id_bytes(public_proto))


def embedded_public_key(peer_id: str) -> bytes | None:
    """The serialised public key inside an identity-multihash peer id (Ed25519); None for hashed ids (RSA)."""
    if not _PEER_ID_TEXT.fullmatch(peer_id):
        raise PeerKeyError("not a base58 peer id")
    raw = b58decode(peer_id)
    code, pos = _read_varint(raw, 0)
    size, pos = _read_varint(raw, pos)
    if len(raw) - pos != size:
        raise PeerKeyError("peer id multihash length does not match its digest")
    if code == _MH_IDENTITY:
        return raw[pos:]
    if code == _MH_SHA256 and size == 32:
        return None
    raise PeerKeyError(f"peer id uses multihash code {code:#x}, not identity or sha2-256")


@dataclass(frozen=True)
class PeerPublicKey:
    """A peer's libp2p public key, able to check signatures made with its private key."""

    key_type: int
    data: bytes

    @classmethod
    def from_proto(cls, blob: bytes) -> "PeerPublicKey":
        if len(blob) > MAX_PUBLIC_KEY_BYTES:
            raise PeerKeyError(f"public key of {len(blob)} bytes")
        key_type, data = decode_key_proto(blob)
        if key_type == KEY_ED25519:
            if len(data) != 32:
                raise PeerKeyError("an Ed25519 public key is 32 bytes")
        elif key_type == KEY_RSA:
            try:
                key = serialization.load_der_public_key(data)
            except (ValueError, UnsupportedAlgorithm):
                raise PeerKeyError("RSA public key is not DER SubjectPublicKeyInfo") from None
            if not isinstance(key, rsa.RSAPublicKey) or key.key_size < MIN_RSA_BITS:
                raise PeerKeyError(f"RSA public keys must be RSA of at least {MIN_RSA_BITS} bits")
        else:
            raise PeerKeyError(f"libp2p key type {key_type} is not supported (Ed25519 = 1, RSA = 0)")
        return cls(key_type, data)

    @classmethod
    def for_peer(cls, peer_id: str, public_key: bytes | None = None) -> "PeerPublicKey":
        """The key that owns `peer_id`: read from the id itself (Ed25519), or `public_key` if it hashes to the id."""
        embedded = embedded_public_key(peer_id)
        if embedded is not None:
            if public_key is not None and public_key != embedded:
                raise PeerKeyError("public key given for a peer id that embeds a different one")
            return cls.from_proto(embedded)
        if public_key is None:
            raise PeerKeyError("this peer id is a hash of its key (RSA): the record must carry the public key")
        if peer_id_of(public_key) != peer_id:
            raise PeerKeyError("public key does not hash to the peer id")
        return cls.from_proto(public_key)

    @property
    def proto(self) -> bytes:
        return encode_key_proto(self.key_type, self.data)

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.proto)

    @property
    def embedded(self) -> bool:
        """True when the peer id carries this key, so records need not."""
        return len(self.proto) <= _MAX_INLINE_KEY

    def verify(self, domain: bytes, message: bytes, signature: bytes) -> bool:
        try:
            if self.key_type == KEY_ED25519:
                Ed25519PublicKey.from_public_bytes(self.data).verify(signature, domain + message)
            else:
                key = serialization.load_der_public_key(self.data)
                assert isinstance(key, rsa.RSAPublicKey)
                key.verify(signature, domain + message, padding.PKCS1v15(), hashes.SHA256())
            return True
        except (InvalidSignature, ValueError):
            return False


class PeerKey:
    """A libp2p private key (the daemon's identity), in the file format p2pd's `-id` flag loads.

    >>> key = PeerKey.generate()
    >>> key.save(path)                      # then P2P.create(identity_path=path) has peer id key.peer_id
    >>> sig = key.sign(DOMAIN_CARD, payload)
    >>> PeerPublicKey.for_peer(key.peer_id).verify(DOMAIN_CARD, payload, sig)
    True
    """

    def __init__(self, private: Ed25519PrivateKey | rsa.RSAPrivateKey):
        self._private = private
        if isinstance(private, Ed25519PrivateKey):
            raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            self.public = PeerPublicKey(KEY_ED25519, raw)
        else:
            der = private.public_key().public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            self.public = PeerPublicKey(KEY_RSA, der)
        self.peer_id = self.public.peer_id

    @classmethod
    def generate(cls) -> "PeerKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_proto(cls, blob: bytes) -> "PeerKey":
        key_type, data = decode_key_proto(blob)
        if key_type == KEY_ED25519:
            if len(data) not in (64, 96):  # seed ‖ public (go-libp2p also reads a legacy 96-byte form)
                raise PeerKeyError(f"an Ed25519 private key is 64 bytes, got {len(data)}")
            private = Ed25519PrivateKey.from_private_bytes(data[:32])
            public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            if data[32:64] != public:
                raise PeerKeyError("Ed25519 private key: the public half does not match the seed")
            return cls(private)
        if key_type == KEY_RSA:
            try:
                private_rsa = serialization.load_der_private_key(data, password=None)
            except (ValueError, TypeError, UnsupportedAlgorithm):
                raise PeerKeyError("RSA private key is not DER") from None
            if not isinstance(private_rsa, rsa.RSAPrivateKey) or private_rsa.key_size < MIN_RSA_BITS:
                raise PeerKeyError(f"RSA identity keys must be at least {MIN_RSA_BITS} bits")
            return cls(private_rsa)
        raise PeerKeyError(f"libp2p key type {key_type} is not supported (Ed25519 = 1, RSA = 0)")

    @classmethod
    def load(cls, path: Path) -> "PeerKey":
        try:
            blob = Path(path).read_bytes()
        except OSError as e:
            raise PeerKeyError(f"cannot read the identity file {path}: {e}") from None
        if blob.lstrip().startswith(b"-----BEGIN"):
            raise PeerKeyError(
                f"identity file {path} is a PEM file (a policy key from `echo2swarm keygen`?), not a libp2p "
                "private key: give --identity a path of its own, and the daemon creates an Ed25519 key there"
            )
        try:
            return cls.from_proto(blob)
        except PeerKeyError as e:
            raise PeerKeyError(f"identity file {path} is not a libp2p private key: {e}") from None

    @property
    def kind(self) -> str:
        """`Ed25519`, or `RSA-<bits>`: what `echo2swarm doctor` says of an identity file."""
        return "Ed25519" if isinstance(self._private, Ed25519PrivateKey) else f"RSA-{self._private.key_size}"

    def to_proto(self) -> bytes:
        if isinstance(self._private, Ed25519PrivateKey):
            seed = self._private.private_bytes(
                serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
            )
            return encode_key_proto(KEY_ED25519, seed + self.public.data)
        der = self._private.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
        return encode_key_proto(KEY_RSA, der)

    def save(self, path: Path) -> None:
        """Write the key file, readable by its owner only; refuses to overwrite."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.to_proto())

    @property
    def is_ed25519(self) -> bool:
        return self.public.key_type == KEY_ED25519

    def sign(self, domain: bytes, message: bytes) -> bytes:
        if isinstance(self._private, Ed25519PrivateKey):
            return self._private.sign(domain + message)
        return self._private.sign(domain + message, padding.PKCS1v15(), hashes.SHA256())
