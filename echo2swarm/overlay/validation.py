"""Store-time validation of our swarm's DHT records, run by every node for every store and get.

hivemind hands validators the hashed key id, not the key string, so the ids of our swarm's shared
keys (the head; the card shards at every depth, overlay/dht_keys.py) are computed once up front,
and a per-peer key (`<swarm>/card/<id>`, `<swarm>/roster/<id>`) is recognised by hashing the key
its subkey (a peer id) names. Records under our keys must match their schema. Peer cards and
rosters must be signed by the libp2p key of the peer id they are stored under (so only a peer
writes its own), be dated within CARD_CLOCK_SKEW_S of our clock and not outlive their signed
expiry; a card shard takes only the cards whose peer ids hash into it (so a flood lands where its
keys fall, and filling one chosen shard costs ~2**depth key generations a card). Head records
must be signed by the key their subkey names, so nobody can overwrite another signer's head.
Dictionary entries under other keys are only size-checked; plain values are refused under every
key (one would shadow a per-peer dictionary).

hivemind validates every subkey of a dictionary on every get reply, so a reply carrying a flood
of cards is checked card by card: verdicts on the card bytes are cached (bounded LRU; the verdict
and the two signed times, not the parsed card, so a flood's cards cost little memory), and only
the time checks, which depend on the clock, are redone.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.overlay.dht_keys import all_shard_keys, card_key, head_key, roster_key, shard_of
from echo2swarm.wire.records import (
    HEAD_EXPIRY_SLACK_S,
    MAX_CARD_BYTES,
    MAX_RECORD_BYTES,
    MAX_RECORD_TTL_S,
    MAX_SUBKEY_BYTES,
    PeerCard,
    RecordError,
    RosterRecord,
    check_times,
    parse_card,
    parse_head,
    parse_roster,
)
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
PARSED_CACHE = 512  # parsed cards kept for readers (2 x the default overlay.max_cards); verdicts: cache_size


def key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


class SwarmRecordValidator(RecordValidatorBase):
    """`refused` counts refusals (served in /v1/info as stats.dht_refused); `reasons`, refused cards and
    rosters by kind."""

    def __init__(self, swarm: str, cache_size: int = 4096):
        self.swarm = swarm
        # card shards at every depth (overlay/dht_keys.py; depth 0 is <swarm>/peers) -> (depth, shard)
        self._shards = {key_id(k): where for k, where in all_shard_keys(swarm).items()}
        self._head_id = key_id(head_key(swarm))
        self.refused = 0
        self.reasons: Counter[str] = Counter()
        self._cards: OrderedDict[bytes, tuple[int, int] | RecordError] = OrderedDict()  # verdicts
        self._parsed: OrderedDict[bytes, PeerCard] = OrderedDict()  # the cards readers used lately
        self._cache_size = cache_size

    def validate(self, record: DHTRecord) -> bool:
        ok, why = self._check(record)
        if not ok:
            self.refused += 1
            logger.info("refused DHT record: %s", why)
        return ok

    def card(self, subkey: str, value: object, value_bytes: bytes) -> PeerCard:
        """The card a record carries if its schema, subkey and signature hold (cached); raises RecordError."""
        tag, _ = self._card_times(subkey, value, value_bytes)
        card = self._parsed.get(tag)
        if card is None:
            card = self._parsed[tag] = parse_card(value)
            while len(self._parsed) > PARSED_CACHE:
                self._parsed.popitem(last=False)
        else:
            self._parsed.move_to_end(tag)
        return card

    def _card_times(self, subkey: str, value: object, value_bytes: bytes) -> tuple[bytes, tuple[int, int]]:
        """(cache tag, (updated_ms, expires_ms)) of a card whose schema, subkey and signature hold; raises
        RecordError. Verdicts are cached by the record's bytes: a flood of big cards costs ~100 bytes each."""
        tag = hashlib.sha256(subkey.encode() + b"\0" + value_bytes).digest()
        verdict = self._cards.get(tag)
        if verdict is None:
            try:
                card = parse_card(value)
                if card.peer_id != subkey:
                    raise RecordError(f"card for {card.peer_id} stored under subkey {subkey[:16]}", "subkey")
                card.check_signature(self.swarm)
                verdict = (card.updated_ms, card.expires_ms)
                self._parsed[tag] = card
            except RecordError as e:
                verdict = e
            self._cards[tag] = verdict
            while len(self._cards) > self._cache_size:
                self._cards.popitem(last=False)
            while len(self._parsed) > PARSED_CACHE:
                self._parsed.popitem(last=False)
        else:
            self._cards.move_to_end(tag)
        if isinstance(verdict, RecordError):
            raise verdict
        return tag, verdict

    def roster(self, subkey: str, value: object) -> RosterRecord:
        """The roster a record carries if its schema, subkey and signature hold; raises RecordError."""
        roster = parse_roster(value)
        if roster.peer_id != subkey:
            raise RecordError(f"roster of {roster.peer_id} stored under subkey {subkey[:16]}", "subkey")
        roster.check_signature(self.swarm)
        return roster

    def kind(self, record: DHTRecord) -> str | None:
        """Which of our records `record` is: "peers" (a card shard), "head", "card", "roster", or None (not ours)."""
        if record.key in self._shards:
            return "peers"
        if record.key == self._head_id:
            return "head"
        if not 0 < len(record.subkey) <= MAX_SUBKEY_BYTES:
            return None
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # not a subkey of ours
            return None
        if not isinstance(subkey, str) or not 20 <= len(subkey) <= 128:
            return None
        if record.key == key_id(card_key(self.swarm, subkey)):
            return "card"
        if record.key == key_id(roster_key(self.swarm, subkey)):
            return "roster"
        return None

    def _check(self, record: DHTRecord) -> tuple[bool, str]:
        if len(record.value) > MAX_RECORD_BYTES:
            return False, f"value of {len(record.value)} bytes exceeds {MAX_RECORD_BYTES}"
        kind = self.kind(record)
        if kind is None:
            if record.subkey == DHTProtocol.IS_REGULAR_VALUE:
                # We store dictionaries only. A plain value replaces a dictionary that expires sooner (hivemind's
                # storage), and a per-peer key cannot be told from any other here: refusing them everywhere keeps
                # anyone from blanking a peer's card or roster key for an hour.
                return False, "a plain (non-dictionary) value"
            return True, ""
        if len(record.subkey) > MAX_SUBKEY_BYTES:
            return False, f"subkey of {len(record.subkey)} bytes"
        if record.expiration_time > time.time() + MAX_RECORD_TTL_S:
            # Far-future expirations would let one store pin a record (hivemind keeps the latest expiry).
            return False, f"expiration more than {MAX_RECORD_TTL_S:.0f} s ahead"
        try:
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # any decoding failure of attacker-controlled bytes is a refusal
            return False, "undecodable record"
        if not isinstance(subkey, str):
            return False, "record under a swarm key without a string subkey"
        try:
            if kind in ("peers", "card"):
                if len(record.value) > MAX_CARD_BYTES:
                    raise RecordError(f"card of {len(record.value)} bytes exceeds {MAX_CARD_BYTES}", "size")
                if kind == "peers":  # before the signature: a hash costs less than a verification
                    bits, shard = self._shards[record.key]
                    if shard_of(subkey, bits) != shard:  # or one key could gather a flood's cards from any id
                        raise RecordError(f"card of {subkey[-8:]} in shard {shard} of depth {bits}, not its own "
                                          f"({shard_of(subkey, bits)})", "shard")
                _, (updated_ms, expires_ms) = self._card_times(subkey, value, record.value)
                check_times(f"card of {subkey[-8:]}", updated_ms, expires_ms, record.expiration_time)
            elif kind == "roster":
                self.roster(subkey, value).check_times(record.expiration_time)
            else:
                head = parse_head(value)
                if head.public_key != subkey:
                    return False, "head stored under another signer's subkey"
                if head.swarm != self.swarm:
                    return False, f"head for swarm {head.swarm!r}"
                if not head.signature_ok():
                    return False, f"head v{head.version} with a bad signature"
                if record.expiration_time > head.expires_ms / 1000 + HEAD_EXPIRY_SLACK_S:
                    return False, f"head v{head.version} stored past its signed expiry (a replay?)"
        except RecordError as e:
            self.reasons[e.reason] += 1
            return False, str(e)
        except Exception as e:  # attacker-controlled bytes must never raise into hivemind
            self.reasons["malformed"] += 1
            return False, f"unusable record ({type(e).__name__})"
        return True, ""

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False
