"""rejoin.json: what a daemon keeps to rejoin by, and how a damaged or foreign file is read (overlay/rejoin.py)."""

from __future__ import annotations

import json
from pathlib import Path

from echo2swarm.overlay.rejoin import FILE, LIMIT, MAX_AGE_S, MAX_MADDRS, RejoinList, dial_order

A = "12D3KooWQDdRUxJPnaZViGoiqaKo6K7SPaFA9aqC5S84L2v21xeC"
B = "12D3KooWLw21MXfiAyVhDfk6umAQgBGgpStPKMMhMGb2LADtCXsG"
RELAY = "12D3KooWKSHMAi1UUANoZekakZwjsG9svCKJXjrAt3MtGG2xfGuA"


def test_saved_peers_come_back_as_dialable_addresses_best_first(tmp_path: Path) -> None:
    saved = RejoinList(tmp_path, "s1", clock=lambda: 1000.0)
    circuit = f"/ip4/8.8.4.4/tcp/4001/p2p/{RELAY}/p2p-circuit"
    assert saved.update({A: [circuit, "/ip4/10.0.0.2/tcp/4001", "/ip4/8.8.8.8/tcp/4001"], B: ["/ip4/127.0.0.1/tcp/5"]})
    loaded = RejoinList(tmp_path, "s1", clock=lambda: 2000.0).load()
    assert loaded == [f"/ip4/8.8.8.8/tcp/4001/p2p/{A}", f"/ip4/10.0.0.2/tcp/4001/p2p/{A}", f"{circuit}/p2p/{A}",
                      f"/ip4/127.0.0.1/tcp/5/p2p/{B}"]


def test_an_unchanged_set_is_not_written_again_and_an_empty_one_keeps_the_last(tmp_path: Path) -> None:
    saved = RejoinList(tmp_path, "s1")
    peers = {A: ["/ip4/8.8.8.8/tcp/1"], B: ["/ip4/8.8.4.4/tcp/2"]}
    assert saved.update(peers)
    assert not saved.update(dict(reversed(list(peers.items()))))  # newest-first order changes; the set does not
    assert not saved.update({})  # lost every peer: the way back to them stays
    assert len(RejoinList(tmp_path, "s1").load()) == 2


def test_the_list_is_bounded(tmp_path: Path) -> None:
    ids = [f"12D3KooW{i:044d}".replace("0", "z") for i in range(LIMIT * 3)]  # base58 has no 0
    many = {peer: [f"/ip4/8.8.8.{i % 250}/tcp/{p}" for p in range(1, 10)] for i, peer in enumerate(ids)}
    RejoinList(tmp_path, "s1").update(many)
    doc = json.loads((tmp_path / FILE).read_text())
    assert len(doc["peers"]) == LIMIT and all(len(p["maddrs"]) == MAX_MADDRS for p in doc["peers"])
    assert dial_order([f"/ip4/8.8.8.8/tcp/{p}" for p in range(1, 10)]) == [f"/ip4/8.8.8.8/tcp/{p}" for p in range(1, 5)]


def test_a_damaged_foreign_or_stale_file_gives_nothing_to_rejoin_by(tmp_path: Path) -> None:
    path = tmp_path / FILE
    good = {"swarm": "s1", "saved_at": 1000.0, "peers": [{"peer_id": A, "maddrs": ["/ip4/8.8.8.8/tcp/1"]}]}
    reader = RejoinList(tmp_path, "s1", clock=lambda: 1000.0)
    assert reader.load() == []  # no file yet
    for text in ["{not json", "[]", json.dumps({**good, "swarm": "other"}), json.dumps({**good, "saved_at": "x"}),
                 json.dumps({**good, "peers": "x"}), "x" * 70000]:
        path.write_text(text)
        assert reader.load() == [], text[:40]
    path.write_text(json.dumps(good))
    assert RejoinList(tmp_path, "s1", clock=lambda: 1000.0 + MAX_AGE_S + 1).load() == []
    # Bad entries are skipped, good ones kept: a peer id that is not one, an address with our own /p2p/ part
    # or garbage, a non-list.
    path.write_text(json.dumps({**good, "peers": [
        {"peer_id": "../../etc", "maddrs": ["/ip4/8.8.8.8/tcp/1"]},
        {"peer_id": B, "maddrs": [f"/ip4/8.8.8.8/tcp/1/p2p/{A}", "/nonsense/1", 7, "/ip4/8.8.4.4/tcp/9"]},
        {"peer_id": A, "maddrs": "x"}, "x", *good["peers"]]}))
    assert reader.load() == [f"/ip4/8.8.4.4/tcp/9/p2p/{B}", f"/ip4/8.8.8.8/tcp/1/p2p/{A}"]
