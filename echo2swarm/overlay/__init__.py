"""The DHT overlay and libp2p: the only package that imports hivemind.

    node.py          the DHT node and its p2pd child (`Overlay`), record stores and bounded reads
    dht_keys.py      every DHT key of a swarm
    validation.py    store-time validation of our records (their schemas are in `wire/records.py`)
    announcer.py     periodic re-announcement of a peer's records
    census.py        live cards and heads as rows for tables and JSON
    rpc.py           typed `rpc_<verb>` calls over libp2p streams
    streams.py       bulk bytes over libp2p streams (chunks for peers reachable only this way)
    reachability.py  the dial-back probe, relay slots and hole punching: how others reach us
    addresses.py     multiaddrs as p2pd reads them, and which of ours others can use
"""
