"""Which peer sends an HTTP request: a credential signed by its libp2p key, for one server, now, once.

    follower ── GET /v1/head?... + X-E2S-Peer: <peer id> <unix ms> <nonce> <signature>[ <public key>] ──► chunk server
                signed (wire/peer_keys.py): DOMAIN_HTTP_PEER ‖ "<server peer id>\\n<path>\\n<unix ms>\\n<nonce>"

Over HTTP a chunk server otherwise tells clients apart by IP address only, which an attacker with
many addresses defeats; over libp2p the peer id is authenticated already. The credential says who
asks (only the owner of the peer id's key can sign), to whom (the server's peer id: a credential
shown to one server is worthless at any other, so a hostile source cannot replay what our fetcher
sent it), when (within `chunk_server.auth_window_s` of the server's clock) and once (the nonce is
remembered for the window: a replay is refused). Fields are space-separated: the peer id in
base58, the time in Unix milliseconds, a nonce of 32 hex digits, the signature in hex, and, for a
peer id that is a hash of an RSA key, that public key (protobuf, hex).

`PeerSigner` makes credentials (the fetcher's side, sent through `SignedSession`); `CredentialCheck`
checks them (the server's) and counts each outcome as `auth_<outcome>`: ok, malformed, stale,
forged, replayed.

>>> signer = PeerSigner(overlay.key)
>>> headers = signer.headers(audience=server_peer_id, path="/v1/head")
>>> check = CredentialCheck(audience=server_peer_id, window_s=30.0, stats=stats)
>>> check.verify(request.headers.get(HEADER), request.path)   # the peer id, or None; raises Forged/Replayed
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from echo2swarm.wire.peer_keys import PeerKey, PeerKeyError, PeerPublicKey

HEADER = "X-E2S-Peer"
DOMAIN_HTTP_PEER = b"echo2swarm/http-peer/v1\n"
MAX_HEADER_CHARS = 4096  # an RSA-4096 credential (signature and key in hex) is under 2,000
MAX_NONCES = 65536  # credentials remembered within the window at most (then the oldest are forgotten)
_FIELDS = re.compile(
    r"([1-9A-HJ-NP-Za-km-z]{20,128}) ([0-9]{1,16}) ([0-9a-f]{32}) ([0-9a-f]{128,1024})(?: ([0-9a-f]{2,2048}))?"
)


class CredentialRefused(Exception):
    """A credential that verifies as no honest peer's would: answered 401. `reason`: forged, replayed."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(detail)


def _message(audience: str, path: str, ts_ms: int, nonce: str) -> bytes:
    return f"{audience}\n{path}\n{ts_ms}\n{nonce}".encode()


class PeerSigner:
    """Credentials of our peer id (the daemon's libp2p key), one per request."""

    def __init__(self, key: PeerKey, clock: Callable[[], float] = time.time):
        self.key = key
        self.clock = clock
        self._key_hex = "" if key.public.embedded else " " + key.public.proto.hex()

    def credential(self, audience: str, path: str) -> str:
        ts_ms, nonce = int(self.clock() * 1000), os.urandom(16).hex()
        signature = self.key.sign(DOMAIN_HTTP_PEER, _message(audience, path, ts_ms, nonce))
        return f"{self.key.peer_id} {ts_ms} {nonce} {signature.hex()}{self._key_hex}"

    def headers(self, audience: str | None, path: str) -> dict[str, str]:
        """The header to send with a GET of `path` to the server whose peer id is `audience` (none if unknown)."""
        return {HEADER: self.credential(audience, path)} if audience else {}


class SignedSession:
    """An aiohttp session as one server's client sees it: every GET carries our credential for that
    server (`audience`, its peer id). `HttpSource` takes it where it takes a session.

    >>> source = HttpSource(SignedSession(session, signer, card.peer_id), card.chunk_url, config)
    """

    def __init__(self, session: aiohttp.ClientSession, signer: PeerSigner, audience: str):
        self.session, self.signer, self.audience = session, signer, audience

    def get(self, url: str, **kwargs: Any) -> Any:
        headers = {**(kwargs.pop("headers", None) or {}), **self.signer.headers(self.audience, URL(url).path)}
        return self.session.get(url, headers=headers, **kwargs)


@dataclass(frozen=True)
class Credential:
    peer_id: str
    ts_ms: int
    nonce: str
    signature: bytes
    public_key: bytes | None


def parse(header: str) -> Credential | None:
    """The credential's fields, or None when it is not one (too long, a field missing or malformed)."""
    if len(header) > MAX_HEADER_CHARS:
        return None
    m = _FIELDS.fullmatch(header.strip())
    if m is None or len(m.group(4)) % 2 or (m.group(5) is not None and len(m.group(5)) % 2):
        return None
    return Credential(m.group(1), int(m.group(2)), m.group(3), bytes.fromhex(m.group(4)),
                      bytes.fromhex(m.group(5)) if m.group(5) else None)


class CredentialCheck:
    """The server's side: is this request's credential a fresh, unreplayed one of the peer it names, for us?"""

    def __init__(self, audience: str, window_s: float, stats: Counter[str], clock: Callable[[], float] = time.time,
                 max_nonces: int = MAX_NONCES):
        self.audience = audience  # our own peer id
        self.window_s = window_s
        self.stats = stats
        self.clock = clock
        self.max_nonces = max_nonces
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()  # (peer, nonce) -> forget after (clock)

    @staticmethod
    def claimed(header: str | None) -> str | None:
        """The peer id a credential names, unchecked (cheap: to decide whether checking is worth it)."""
        credential = parse(header) if header else None
        return credential.peer_id if credential is not None else None

    def verify(self, header: str | None, path: str) -> str | None:
        """The peer id whose owner signed this request for us just now, or None: no credential, a malformed
        one or one outside the time window (the request is then anyone's). Raises CredentialRefused for a
        signature that does not verify (forged, or made for another server or path) or one seen before."""
        if not header:
            return None
        credential = parse(header)
        if credential is None:
            self.stats["auth_malformed"] += 1
            return None
        now = self.clock()
        if abs(now * 1000 - credential.ts_ms) > self.window_s * 1000:
            self.stats["auth_stale"] += 1
            return None
        try:
            key = PeerPublicKey.for_peer(credential.peer_id, credential.public_key)
        except PeerKeyError as e:
            self.stats["auth_forged"] += 1
            raise CredentialRefused("forged", f"credential key: {e}") from None
        message = _message(self.audience, path, credential.ts_ms, credential.nonce)
        if not key.verify(DOMAIN_HTTP_PEER, message, credential.signature):
            self.stats["auth_forged"] += 1
            raise CredentialRefused("forged", "the credential's signature does not verify for this server and path")
        self._forget(now)
        seen = (credential.peer_id, credential.nonce)
        if seen in self._seen:
            self.stats["auth_replayed"] += 1
            raise CredentialRefused("replayed", "this credential was used before")
        self._seen[seen] = now + 2 * self.window_s  # past that its timestamp is stale anyway
        while len(self._seen) > self.max_nonces:
            self._seen.popitem(last=False)
        self.stats["auth_ok"] += 1
        return credential.peer_id

    def _forget(self, now: float) -> None:
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
