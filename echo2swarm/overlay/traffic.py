"""What the DHT costs this node: the requests it sent and served, and their bytes, by RPC.

    hivemind DHTProtocol stubs ── P2P.call_protobuf_handler("DHTProtocol.rpc_<op>") ──► sent[op]
    peers' DHT requests        ── handler registered by P2P.add_protobuf_handler(...) ──► served[op]

Counted where hivemind's DHT meets this node's P2P instance, so every DHT message is counted once,
whoever caused it: the announcer, card and head reads, the DHT's own routing and replication. A
message's bytes are its protobuf size (request plus reply), without libp2p's framing. Ops are the
DHT's RPCs (ping, store, find); nothing a peer sends names a counter. The daemon shows them in
/v1/info (stats.dht_requests, stats.dht_bytes) and as Prometheus counters: a swarm's per-node control
traffic, measured.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P

DHT_HANDLER = "DHTProtocol.rpc_"
OPS = ("ping", "store", "find")


def _op(name: str) -> str | None:
    """`find` for "DHTProtocol.rpc_find" (any namespace prefix); None for anything not the DHT's."""
    _, found, op = name.rpartition(DHT_HANDLER)
    if not found:
        return None
    return op if op in OPS else "other"


def _size(message: Any) -> int:
    size = getattr(message, "ByteSize", None)
    return int(size()) if callable(size) else 0


class DhtTraffic:
    """Requests and bytes by `<direction>_<op>` (e.g. `sent_find`, `served_store`); failed calls count
    their request only."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def count(self, direction: str, op: str, request: Any, reply: Any = None) -> None:
        key = f"{direction}_{op}"
        self.requests[key] += 1
        self.bytes[key] += _size(request) + _size(reply)

    def totals(self) -> dict[str, int]:
        """All directions and ops together: requests and bytes."""
        return {"requests": sum(self.requests.values()), "bytes": sum(self.bytes.values())}

    def instrument(self, p2p: P2P) -> P2P:
        """Count the DHT's messages on `p2p` from now on (before `DHTNode.create` registers its handlers)."""
        call, add = p2p.call_protobuf_handler, p2p.add_protobuf_handler

        async def counted_call(peer_id: Any, name: str, request: Any, reply_type: Any) -> Any:
            op = _op(name)
            if op is None or not hasattr(request, "ByteSize"):  # not the DHT's, or a stream
                return await call(peer_id, name, request, reply_type)
            reply = None
            try:
                reply = await call(peer_id, name, request, reply_type)
                return reply
            finally:
                self.count("sent", op, request, reply)

        async def counted_add(name: str, handler: Callable[..., Any], request_type: Any, **kwargs: Any) -> None:
            op = _op(name)
            if op is not None and not kwargs.get("stream_input") and not kwargs.get("stream_output"):
                handler = self._serving(op, handler)
            await add(name, handler, request_type, **kwargs)

        p2p.call_protobuf_handler = counted_call  # type: ignore[method-assign]
        p2p.add_protobuf_handler = counted_add  # type: ignore[method-assign]
        return p2p

    def _serving(self, op: str, handler: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
        async def counted(request: Any, context: Any) -> Any:
            reply = None
            try:
                reply = await handler(request, context)
                return reply
            finally:
                self.count("served", op, request, reply)

        return counted
