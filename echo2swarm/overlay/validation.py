"""Store-time validation of our swarm's DHT records, run by every node for every store and get.

hivemind hands validators the hashed key id, not the key string, so the ids of our swarm's keys
are computed once up front. Records under our keys must match their schema; head records must be
signed by the key their subkey names, so nobody can overwrite another signer's head. Records
under other keys are only size-checked.
"""

from __future__ import annotations

import time

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from echo2swarm.overlay.dht_keys import head_key, peers_key
from echo2swarm.wire.records import (
    HEAD_EXPIRY_SLACK_S,
    MAX_RECORD_BYTES,
    MAX_RECORD_TTL_S,
    MAX_SUBKEY_BYTES,
    RecordError,
    parse_card,
    parse_head,
)
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)


def key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


class SwarmRecordValidator(RecordValidatorBase):
    def __init__(self, swarm: str):
        self.swarm = swarm
        self._peers_id = key_id(peers_key(swarm))
        self._head_id = key_id(head_key(swarm))
        self.refused = 0

    def validate(self, record: DHTRecord) -> bool:
        ok, why = self._check(record)
        if not ok:
            self.refused += 1
            logger.info("refused DHT record: %s", why)
        return ok

    def _check(self, record: DHTRecord) -> tuple[bool, str]:
        if len(record.value) > MAX_RECORD_BYTES:
            return False, f"value of {len(record.value)} bytes exceeds {MAX_RECORD_BYTES}"
        if record.key not in (self._peers_id, self._head_id):
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
            if record.key == self._peers_id:
                card = parse_card(value)
                if card.peer_id != subkey:
                    return False, f"card for {card.peer_id} stored under subkey {subkey[:16]}"
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
            return False, str(e)
        return True, ""

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False
