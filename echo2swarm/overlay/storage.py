"""What a DHT node of ours keeps for others: hivemind's local storage, every dictionary bounded in bytes.

    rpc_store (any peer) ─► validator (overlay/validation.py) ─► BoundedStorage.store_subkey
        a new or larger entry that would take its dictionary past its bound is refused (counted)
    rpc_find (any peer)  ─► one reply with the whole dictionary: never over hivemind's message cap

Why: hivemind answers a find with a key's whole dictionary in one message, capped at 4 MiB. A
dictionary past that (a flood of validly signed cards under one card shard; junk under one peer's
own key) fails every such reply whole: the asker waits out its timeout, blacklists this node for
its other keys too, and hivemind 1.1.12 leaks the unsent reply (~3x its size) here. Bounded, the
shared keys (every card shard, overlay/dht_keys.py, and `<swarm>/head`) keep what came first and
renewals of it (a held subkey may grow past the bound by RENEWAL_SLACK); a per-peer key holds its
one record and little else. Nothing a reader needs depends on a shard alone (overlay/cards.py reads
peers it has evidence for by their own keys), and a flood fills only the shards its keys fall in.
"""

from __future__ import annotations

from collections.abc import Collection

from hivemind.dht.routing import DHTID, Subkey
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils.timed_storage import DHTExpiration

SHARED_DICT_BYTES = 3 * 1024 * 1024  # under the 4 MiB message cap with the reply's framing and neighbours
OTHER_DICT_BYTES = 64 * 1024  # a per-peer key's record (≤ 16 KiB) and then some; 16 of them fit one reply
RENEWAL_SLACK = 1 / 8  # a subkey already held may grow its dictionary this much further: renewals are never refused


class BoundedStorage(DHTLocalStorage):
    """DHTLocalStorage whose dictionaries stay within SHARED_DICT_BYTES (keys in `shared`) or OTHER_DICT_BYTES.

    >>> storage = BoundedStorage(shared={DHTID.generate(source="demo/peers")})
    >>> node.protocol.storage = storage          # what Overlay.start does, right after the node exists
    """

    def __init__(self, shared: Collection[DHTID] = (), maxsize: int | None = None):
        super().__init__(maxsize=maxsize)
        self.shared = set(shared)
        self.refused = 0  # entries refused for their dictionary's bound
        self._sizes: dict[DHTID, tuple[int, int]] = {}  # key -> (entries, value bytes) after our last store

    @classmethod
    def replacing(cls, old: DHTLocalStorage, shared: Collection[DHTID]) -> "BoundedStorage":
        """A bounded storage holding what `old` holds (a node may have been asked to store during its start)."""
        new = cls(shared, maxsize=None if old.maxsize == float("inf") else int(old.maxsize))
        for key, item in old.items():
            if isinstance(item.value, DictionaryDHTValue):
                for subkey, entry in item.value.items():
                    new.store_subkey(key, subkey, entry.value, entry.expiration_time)
            else:
                new.store(key, item.value, item.expiration_time)
        return new

    def bound(self, key: DHTID) -> int:
        return SHARED_DICT_BYTES if key in self.shared else OTHER_DICT_BYTES

    def store_subkey(self, key: DHTID, subkey: Subkey, value: bytes, expiration_time: DHTExpiration) -> bool:
        current = self.get(key)
        if current is None or not isinstance(current.value, DictionaryDHTValue):
            if len(value) > self.bound(key):
                self.refused += 1
                return False
            stored = super().store_subkey(key, subkey, value, expiration_time)
            if stored:
                self._sizes[key] = (1, len(value))
            return stored
        entries = current.value
        count = len(entries)  # drops expired entries first
        seen = self._sizes.get(key)
        total = seen[1] if seen is not None and seen[0] == count else sum(len(e.value) for _, e in entries.items())
        old = entries.data.get(subkey)
        grows = len(value) - (len(old.value) if old is not None else 0)
        bound = self.bound(key) * (1 + RENEWAL_SLACK if old is not None else 1)
        if grows > 0 and total + grows > bound:
            self.refused += 1
            self._sizes[key] = (count, total)
            return False
        stored = super().store_subkey(key, subkey, value, expiration_time)
        self._sizes[key] = (len(entries), total + grows if stored else total)
        if len(self._sizes) > 2 * len(self.data) + 64:  # keys that expired meanwhile
            self._sizes = {k: v for k, v in self._sizes.items() if k in self.data}
        return stored


__all__ = ["BoundedStorage", "OTHER_DICT_BYTES", "SHARED_DICT_BYTES"]
