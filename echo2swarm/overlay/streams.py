"""Bulk bytes over libp2p: one request, one bounded header, then a raw body, on a fresh stream.

    request  := u32 length ‖ msgpack {op, ...}                (at most 1 KiB)
    response := u32 length ‖ msgpack {status, size[, error]}  (at most 1 KiB) ‖ `size` raw bytes

The fallback transport for chunks when a peer is reachable only through the overlay (NAT, relay):
protobuf messages top out at 4 MiB and would copy every byte twice, so bodies are raw stream
bytes. The caller's identity is the peer id libp2p authenticated (`stream_info.peer_id`); both
header frames are length-checked before they are read, so garbage costs one log line.

    server: await serve_frames(p2p, "echo2swarm/demo/chunks", handle)    # handle(request, peer, out)
    client: async with open_frames(p2p, peer_id, maddrs, "echo2swarm/demo/chunks", {"op": "chunk", ...}, 10) as (head, body):
                data = await body.readexactly(head["size"])
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgpack
from hivemind.p2p import P2P, PeerID
from echo2swarm.overlay.addresses import dial_addrs
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
MAX_FRAME_BYTES = 1024
_LEN = 4


MAX_PATH_PEERS = 256
# p2p -> peer id -> {"direct": n, "relayed": n}: requests answered per connection kind (relayed: the
# stream came over a /p2p-circuit connection); /v1/info shows it, the WAN-lab test checks punched paths.
_PATHS: "weakref.WeakKeyDictionary[Any, OrderedDict[str, dict[str, int]]]" = weakref.WeakKeyDictionary()


def _count_path(p2p: Any, peer: str, stream_info: Any) -> None:
    try:
        path = "relayed" if "/p2p-circuit" in str(stream_info.addr) else "direct"
    except Exception:  # an address hivemind cannot print
        path = "unknown"
    per_peer = _PATHS.setdefault(p2p, OrderedDict())
    counts = per_peer.setdefault(peer, {})
    counts[path] = counts.get(path, 0) + 1
    per_peer.move_to_end(peer)
    while len(per_peer) > MAX_PATH_PEERS:
        per_peer.popitem(last=False)


def stream_paths(p2p: Any) -> dict[str, dict[str, int]]:
    """Bulk-stream requests this node answered, per client peer id and connection kind (direct/relayed)."""
    return {peer: dict(counts) for peer, counts in _PATHS.get(p2p, {}).items()}


class StreamError(Exception):
    """The peer could not be reached over libp2p, or answered something malformed."""


async def _read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    size = int.from_bytes(await reader.readexactly(_LEN), "big")
    if size > MAX_FRAME_BYTES:
        raise StreamError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        value = msgpack.unpackb(await reader.readexactly(size), raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise StreamError(f"undecodable frame: {type(e).__name__}") from None
    if not isinstance(value, dict):
        raise StreamError("frame is not a mapping")
    return value


def _frame(value: dict[str, Any]) -> bytes:
    data = msgpack.packb(value, use_bin_type=True)
    assert len(data) <= MAX_FRAME_BYTES, "frames are small headers"
    return len(data).to_bytes(_LEN, "big") + data


class FrameWriter:
    """What a handler answers with: one header, then the body in blocks (back-pressured)."""

    def __init__(self, writer: asyncio.StreamWriter):
        self._writer = writer
        self.header_sent = False

    async def header(self, status: int, size: int = 0, error: str | None = None, off_path: bool = False) -> None:
        body: dict[str, Any] = {"status": status, "size": size}
        if error:
            body["error"] = error[:300]
        if off_path:  # a 404 for a chunk: the server fetches or holds the version by another path
            body["off_path"] = True
        self._writer.write(_frame(body))
        self.header_sent = True
        await self._writer.drain()

    async def write(self, block: bytes) -> None:
        self._writer.write(block)
        await self._writer.drain()


Handler = Callable[[dict[str, Any], str, FrameWriter], Awaitable[None]]


async def serve_frames(p2p: P2P, name: str, handler: Handler, timeout: float = 120.0) -> None:
    async def _handle(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = stream_info.peer_id.to_base58()
        out = FrameWriter(writer)
        request = None
        try:
            request = await asyncio.wait_for(_read_frame(reader), 10.0)
            _count_path(p2p, peer, stream_info)
            await asyncio.wait_for(handler(request, peer, out), timeout)
        except StreamError as e:
            logger.info("refused %s request from %s: %s", name.rsplit("/", 1)[-1], peer[-8:], e)
            if not out.header_sent:
                with contextlib.suppress(Exception):
                    await out.header(400, error=str(e))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as e:
            logger.debug("%s stream from %s ended: %s", name, peer[-8:], type(e).__name__)
        except Exception:
            logger.exception("%s handler failed", name)
        finally:
            # p2pd resets a stream whose handler side closes first (its pipe's read then fails), and over QUIC
            # a reset discards the response still in flight: measured in the WAN lab, ~45% of responses
            # between two hole-punched homes arrived as an empty stream. So the client, which closes once it
            # has read everything, closes first; a client that never does is dropped after CLOSE_WAIT_S.
            # (Not after a request that could not be read: such a client may never stop sending.)
            if request is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(_until_eof(reader), min(timeout, CLOSE_WAIT_S))
            writer.close()

    await p2p.add_binary_stream_handler(name, _handle)


CLOSE_WAIT_S = 60.0


async def _until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass


@contextlib.asynccontextmanager
async def open_frames(
    p2p: P2P, peer_id: str, maddrs: list[str], name: str, request: dict[str, Any], timeout: float
) -> AsyncIterator[tuple[dict[str, Any], asyncio.StreamReader]]:
    """Send `request`; yield the response header and a reader positioned at the body."""
    peer = PeerID.from_base58(peer_id)
    writer: asyncio.StreamWriter | None = None
    try:
        try:
            transport = dial_addrs(maddrs)  # direct ones without /p2p/<id>; circuit ones whole, encoded for Go
            if transport:
                with contextlib.suppress(Exception):  # already connected, or reachable through the DHT
                    await asyncio.wait_for(p2p._client.connect(peer, transport), timeout)
            _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, name), timeout)
            writer.write(_frame(request))
            await writer.drain()
            head = await asyncio.wait_for(_read_frame(reader), timeout)
        except StreamError:
            raise
        except Exception as e:  # p2pd raises its own ControlFailure, ConnectionError, timeouts ...
            raise StreamError(f"{name.rsplit('/', 1)[-1]} to {peer_id[-8:]}: {type(e).__name__}: {e}") from None
        if not isinstance(head.get("status"), int) or not isinstance(head.get("size"), int) or head["size"] < 0:
            raise StreamError("response header lacks status/size")
        yield head, reader
    finally:
        if writer is not None:
            writer.close()


def stream_name(swarm: str, what: str) -> str:
    """libp2p protocol id of a bulk stream handler, e.g. `echo2swarm/<swarm>/chunks`."""
    return f"echo2swarm/{swarm}/{what}"
