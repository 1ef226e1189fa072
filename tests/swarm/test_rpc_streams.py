"""Client-streaming RPC and chunk frames between two real overlay nodes over QUIC (overlay/rpc.py,
overlay/streams.py): every reply arrives (the client closes first), oversized frames are refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hivemind.p2p import P2P, PeerID
from pydantic import BaseModel

from echo2swarm.overlay.rpc import RpcError, RpcStub, rpc_name, serve
from echo2swarm.overlay.streams import open_frames, serve_frames, stream_name
from echo2swarm.wire.surfaces import Rpc, Surface
from helpers.overlays import LOOPBACK_QUIC, overlay_pair

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


class Item(BaseModel):
    n: int


class Total(BaseModel):
    total: int


ADDER = Surface("adder", (Rpc("add", Item, (Total,), stream=True),))


class Adder:
    async def rpc_add(self, items: AsyncIterator[Item | RpcError], peer: str) -> Total:
        total = 0
        async for item in items:
            if isinstance(item, RpcError):
                raise item
            total += item.n
        return Total(total=total)


def test_client_stream_replies_and_frames_all_arrive_over_quic() -> None:
    async def scenario() -> tuple[list[object], list[object], str]:
        async with overlay_pair("rpcq", LOOPBACK_QUIC) as (a, b):
            await serve(a.p2p, "rpcq", ADDER, Adder())

            async def echo(request: dict, peer: str, out) -> None:
                await out.header(200, 3)
                await out.write(b"abc")

            await serve_frames(a.p2p, stream_name("rpcq", "echo"), echo)
            stub = RpcStub(b.p2p, "rpcq", ADDER, a.peer_id)
            sums = []
            for k in range(30):
                reply = await stub.add([Item(n=k), Item(n=1)], timeout=10)
                sums.append(reply.total)
            frames = []
            for _ in range(30):
                async with open_frames(b.p2p, a.peer_id, [], stream_name("rpcq", "echo"), {"op": "x"}, 10) as (h, r):
                    frames.append((h["status"], await r.readexactly(h["size"])))
            # A message whose length is over the limit: refused from its header, its body never read.
            name = rpc_name("rpcq", "add")
            _, reader, writer = await b.p2p.call_binary_stream_handler(PeerID.from_base58(a.peer_id), name)
            writer.write(P2P.MESSAGE_MARKER + (10**9).to_bytes(P2P.HEADER_LEN, "big"))
            await writer.drain()
            marker = await asyncio.wait_for(reader.readexactly(1), 10)
            size = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), "big")
            refusal = await reader.readexactly(size)
            writer.close()
            assert marker == P2P.MESSAGE_MARKER
            return sums, frames, refusal.decode(errors="replace")

    sums, frames, refusal = asyncio.run(scenario())
    assert sums == [k + 1 for k in range(30)]
    assert frames == [(200, b"abc")] * 30
    assert "exceeds" in refusal


class Slow(BaseModel):
    n: int


HOLDER = Surface("holder", (Rpc("hold", Slow, (Total,)),))


class Holder:
    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def rpc_hold(self, request: Slow, peer: str) -> Total:
        await self.release.wait()  # as a held lease request waits for work
        return Total(total=request.n)


def test_callers_that_time_out_leave_nothing_behind_in_the_server() -> None:
    """A caller that gives up on a held request gets p2pd to cancel the server's handler; what the
    server keeps per call must go with it, however many callers do that (a crowd of fresh identities
    timing out on held leases for hours)."""

    async def scenario() -> tuple[int, int, int]:
        async with overlay_pair("rpch") as (a, b):
            holder = Holder()
            await serve(a.p2p, "rpch", HOLDER, holder)
            stub = RpcStub(b.p2p, "rpch", HOLDER, a.peer_id)
            timed_out = 0
            for k in range(40):
                try:
                    await stub.hold(Slow(n=k), timeout=0.3)
                except RpcError:
                    timed_out += 1
            handler_tasks = a.p2p._client.control._handler_tasks  # hivemind's table of unary calls being handled
            for _ in range(100):  # the cancellations reach the server's p2pd, then its handlers, a moment later
                if not handler_tasks:
                    break
                await asyncio.sleep(0.05)
            left = len(handler_tasks)
            holder.release.set()
            answered = (await stub.hold(Slow(n=7), timeout=10)).total  # and the server still answers
            return timed_out, left, answered

    timed_out, left, answered = asyncio.run(scenario())
    assert timed_out == 40
    assert left == 0, f"{left} handler tasks of cancelled calls kept"
    assert answered == 7
