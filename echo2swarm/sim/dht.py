"""A cost model of hivemind's DHT: which nodes hold a key, and the bytes every get and store puts
through each node (requests and replies, both directions; what overlay/traffic.py counts on a real
daemon, protobuf framing left out).

    key ─ sha1, first 63 bits ─► the `replicas` (5: DHTNode's num_replicas) nodes nearest by XOR
    get(reader, key, value bytes)  : a beam search (hivemind/dht/traverse.py) that does not stop at the
                                     first value (readers ask with sufficient_expiration_time = inf):
                                     it visits the `beam` (20: bucket_size) nodes nearest the key and
                                     those on the way, `num_workers` (4) a hop, min(N − 1, beam + hops ×
                                     num_workers) finds of LOOKUP_BYTES each way (spread over the swarm);
                                     every visited holder answers with the value, and the value is then
                                     cached on one visited node that lacked it (cache_nearest = 1)
    store(writer, key, value bytes): (a lookup first, as `DHTNode.store` makes; none for card shards,
                                     which `Overlay._store_nearby` stores straight) + the value to
                                     every holder

hops = ceil(log2(N) / 3): an assumption (20-peer buckets resolve a few bits a hop).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

LOOKUP_BYTES = 1200  # a find request and its reply of nearest peers (~20 ids and addresses), no value


class SimDHT:
    """`n` DHT nodes; `bytes[i]` is what went through node i, per second of the rates given."""

    def __init__(self, n: int, seed: int = 0, replicas: int = 5, beam: int = 20, num_workers: int = 4):
        rng = np.random.default_rng(seed)
        self.n = n
        self.ids = rng.integers(0, 2**63, size=n, dtype=np.uint64)
        self.replicas = min(replicas, n)
        hops = max(1, math.ceil(math.log2(max(2, n)) / 3))
        self.finds = max(1, min(n - 1, beam + hops * num_workers))  # nodes a lookup asks
        self.value_replies = max(1, min(self.replicas, n - 1))  # visited holders (the reader's own copy is local)
        self.cache_stores = 1 if self.finds > self.value_replies else 0
        self.bytes = np.zeros(n)
        self.spread = 0.0  # routing bytes that land on nodes along lookup paths: spread evenly
        self._holders: dict[str, np.ndarray] = {}

    def holders(self, key: str) -> np.ndarray:
        """The nodes nearest `key`, nearest first."""
        found = self._holders.get(key)
        if found is None:
            kid = np.uint64(int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") >> 1)
            distance = self.ids ^ kid
            near = np.argpartition(distance, self.replicas - 1)[: self.replicas] if self.replicas < self.n \
                else np.arange(self.n)
            found = self._holders[key] = near[np.argsort(distance[near])]
        return found

    @staticmethod
    def _total(who: int | np.ndarray, rate: float | np.ndarray) -> float:
        """Requests a second by every node in `who` together (one node, or many at per-node rates)."""
        return float(np.sum(rate * np.ones(np.shape(who))))

    def _lookup(self, who: int | np.ndarray, rate: float | np.ndarray) -> None:
        routing = self.finds * LOOKUP_BYTES
        np.add.at(self.bytes, who, rate * routing)
        self.spread += self._total(who, rate) * routing

    def get(self, reader: int | np.ndarray, key: str, value_bytes: float, rate: float | np.ndarray) -> None:
        """`reader` (one node, or many at per-node `rate`s) gets `key`, a value of `value_bytes`, `rate` times a second."""
        self._lookup(reader, rate)
        total = self._total(reader, rate)
        per_read = (self.value_replies + self.cache_stores) * value_bytes
        np.add.at(self.bytes, reader, rate * per_read)
        self.bytes[self.holders(key)[: self.value_replies]] += total * value_bytes
        self.spread += total * self.cache_stores * value_bytes  # the cached copy lands on a node on the way

    def store(self, writer: int | np.ndarray, key: str, value_bytes: float, rate: float | np.ndarray,
              lookup: bool = True) -> None:
        if lookup:
            self._lookup(writer, rate)
        total = self._total(writer, rate)
        np.add.at(self.bytes, writer, rate * self.replicas * value_bytes)
        self.bytes[self.holders(key)] += total * value_bytes

    def per_node(self) -> np.ndarray:
        """Bytes a second through each node, routing spread in."""
        return self.bytes + self.spread / self.n


__all__ = ["LOOKUP_BYTES", "SimDHT"]
