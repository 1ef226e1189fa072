"""DhtTraffic: the DHT's messages on a P2P instance counted by direction and RPC, nothing else."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hivemind.proto import dht_pb2

from echo2swarm.overlay.traffic import DhtTraffic


class _P2P:
    """The two P2P methods the counter wraps: calls answer `reply` (or raise), handlers are kept."""

    def __init__(self, reply: Any = None, error: Exception | None = None):
        self.reply, self.error, self.handlers = reply, error, {}

    async def call_protobuf_handler(self, peer_id: Any, name: str, request: Any, reply_type: Any) -> Any:
        if self.error is not None:
            raise self.error
        return self.reply

    async def add_protobuf_handler(self, name: str, handler: Any, request_type: Any, **kwargs: Any) -> None:
        self.handlers[name] = handler


def test_sent_and_served_dht_messages_are_counted_with_their_sizes() -> None:
    request = dht_pb2.FindRequest(keys=[b"k" * 20, b"j" * 20])
    reply = dht_pb2.FindResponse(results=[dht_pb2.FindResult(value=b"v" * 30)])
    p2p, traffic = _P2P(reply), DhtTraffic()
    traffic.instrument(p2p)  # type: ignore[arg-type]

    async def run() -> None:
        assert await p2p.call_protobuf_handler("peer", "DHTProtocol.rpc_find", request, dht_pb2.FindResponse) is reply
        await p2p.add_protobuf_handler("ns::DHTProtocol.rpc_store", _answer(dht_pb2.StoreResponse()), dht_pb2.StoreRequest)
        await p2p.add_protobuf_handler("swarm/lease", _answer(reply), dht_pb2.FindRequest)  # not the DHT's
        await p2p.handlers["ns::DHTProtocol.rpc_store"](dht_pb2.StoreRequest(keys=[b"x"]), None)
        await p2p.handlers["swarm/lease"](request, None)
        await p2p.call_protobuf_handler("peer", "swarm/lease", request, dht_pb2.FindResponse)

    asyncio.run(run())
    assert traffic.requests == {"sent_find": 1, "served_store": 1}
    assert traffic.bytes["sent_find"] == request.ByteSize() + reply.ByteSize() > 40
    assert traffic.bytes["served_store"] == dht_pb2.StoreRequest(keys=[b"x"]).ByteSize()
    assert traffic.totals() == {"requests": 2, "bytes": sum(traffic.bytes.values())}


def test_a_failed_call_counts_its_request_and_raises() -> None:
    p2p, traffic = _P2P(error=TimeoutError("gone")), DhtTraffic()
    traffic.instrument(p2p)  # type: ignore[arg-type]
    request = dht_pb2.PingRequest()
    with pytest.raises(TimeoutError):
        asyncio.run(p2p.call_protobuf_handler("peer", "DHTProtocol.rpc_ping", request, dht_pb2.PingResponse))
    assert traffic.requests == {"sent_ping": 1}
    # an RPC the DHT does not have (a newer hivemind's) is counted as `other`, never by its name
    asyncio.run(p2p.add_protobuf_handler("DHTProtocol.rpc_gossip", _answer(None), dht_pb2.PingRequest))
    asyncio.run(p2p.handlers["DHTProtocol.rpc_gossip"](request, None))
    assert traffic.requests == {"sent_ping": 1, "served_other": 1}


def _answer(reply: Any) -> Any:
    async def handler(request: Any, context: Any) -> Any:
        return reply

    return handler
