"""What a DHT node keeps for others (overlay/storage.py BoundedStorage): no dictionary past its bound."""

from __future__ import annotations

import time

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage

from echo2swarm.overlay.storage import OTHER_DICT_BYTES, RENEWAL_SLACK, SHARED_DICT_BYTES, BoundedStorage
from echo2swarm.runtime.processes import wait_until

SHARED = DHTID.generate(source="demo/peers")
OTHER = DHTID.generate(source="demo/card/someone")


def test_a_shared_dictionary_stops_taking_new_subkeys_at_its_bound_but_takes_renewals() -> None:
    storage = BoundedStorage(shared={SHARED})
    later = time.time() + 60
    value = b"x" * 6000
    taken = sum(storage.store_subkey(SHARED, f"fake{i}", value, later) for i in range(2000))
    assert taken == SHARED_DICT_BYTES // len(value) and storage.refused == 2000 - taken
    assert sum(len(e.value) for _, e in storage.get(SHARED).value.items()) <= SHARED_DICT_BYTES
    # A held subkey is renewed (a later expiration), even a little larger, within the slack.
    assert storage.store_subkey(SHARED, "fake0", value + b"y" * 100, later + 10)
    assert storage.store_subkey(SHARED, "fake1", value, later + 10)
    assert not storage.store_subkey(SHARED, "newcomer", value, later)
    assert not storage.store_subkey(SHARED, "fake2", b"x" * (int(SHARED_DICT_BYTES * RENEWAL_SLACK) + 8000), later + 10)


def test_other_dictionaries_hold_a_record_and_little_more() -> None:
    storage = BoundedStorage(shared={SHARED})
    later = time.time() + 60
    assert storage.store_subkey(OTHER, "owner", b"c" * 2000, later)
    junk = sum(storage.store_subkey(OTHER, f"junk{i}", b"j" * 16_000, later) for i in range(100))
    assert junk == (OTHER_DICT_BYTES - 2000) // 16_000
    assert not storage.store_subkey(DHTID.generate(source="elsewhere"), "big", b"b" * (OTHER_DICT_BYTES + 1), later)


def test_room_comes_back_as_entries_expire_and_start_time_entries_are_kept() -> None:
    old = DHTLocalStorage()
    soon = time.time() + 0.2
    old.store_subkey(SHARED, "early", b"e" * 100, time.time() + 60)
    storage = BoundedStorage.replacing(old, shared={SHARED})
    assert "early" in storage.get(SHARED).value
    for i in range(SHARED_DICT_BYTES // 100_000):
        assert storage.store_subkey(SHARED, f"short{i}", b"s" * 100_000, soon)
    assert not storage.store_subkey(SHARED, "late", b"l" * 100_000, time.time() + 60)
    # Room frees as the short-lived records expire (0.2 s): wait for it rather than sleep past it.
    wait_until(lambda: storage.store_subkey(SHARED, "late", b"l" * 100_000, time.time() + 60), 5.0, interval=0.05,
               what="the expired records' room to take the late one")
