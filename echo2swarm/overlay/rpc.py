"""Typed RPC over libp2p streams: the surfaces declared in `wire/surfaces.py`, served and called.

    server: await serve(p2p, swarm, LEARNER_RPC, intake)        # intake.rpc_lease, intake.rpc_submit
    client: stub = RpcStub(p2p, swarm, LEARNER_RPC, learner_peer_id)
            reply = await stub.lease(LeaseRequest(max_prompts=8), timeout=10)   # Lease | LeaseWait
            result = await stub.submit([group, ...], timeout=10)                  # SubmitResult

Both ends are derived from one declaration (`Rpc`: verb, request, replies, unary or client stream),
so neither spells a verb or a reply type. `serve` refuses to start when a declared verb has no
`rpc_<verb>` coroutine method, and answers an internal error when a handler returns an undeclared
reply; a stub sends only the declared request type and accepts only the declared replies.

hivemind's P2P speaks protobuf; instead of generating message classes we wrap msgpack bytes in
protobuf's `BytesValue`, and validate them with the pydantic models in `wire/`.
The caller's identity is the peer id libp2p authenticated for the stream (`context.remote_id`),
never something in the message. Malformed or oversized messages get an error reply; the
handler never raises into hivemind, so a garbage-sending peer costs us one log line.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgpack
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto.p2pd_pb2 import RPCError
from pydantic import BaseModel, ValidationError

from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.schema import schema_error
from echo2swarm.wire.surfaces import Rpc, Surface

logger = get_logger(__name__)
# hivemind's persistent connection carries messages up to 4 MiB; stay well inside it.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024 - 64 * 1024
M = TypeVar("M", bound=BaseModel)


class RpcError(Exception):
    """The remote refused the call or answered something we cannot use."""


def rpc_name(swarm: str, verb: str) -> str:
    return f"echo2swarm/{swarm}/rpc_{verb}"


def encode(message: BaseModel | dict[str, Any]) -> BytesValue:
    body = message.model_dump(mode="json") if isinstance(message, BaseModel) else message
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise RpcError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES} byte limit")
    return BytesValue(value=data)


def decode(wrapper: BytesValue, model: type[M]) -> M:
    data = wrapper.value
    if len(data) > MAX_MESSAGE_BYTES:
        raise RpcError(f"message of {len(data)} bytes exceeds the limit")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types on garbage
        raise RpcError(f"undecodable message: {type(e).__name__}") from None
    if isinstance(body, dict) and "error" in body and len(body) == 1:
        raise RpcError(f"remote error: {str(body['error'])[:300]}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RpcError(f"invalid {model.__name__}: {schema_error(e)}") from None


# Callers of answered RPCs are noted as peers that asked for work (overlay/roster.py "asked"): libp2p
# authenticated their peer id, so their cards are worth reading by name, but asking is not working
# (a fresh key is answered too, if only "wait"), so it never makes them "seen doing work".
_CALLER_OBSERVERS: "weakref.WeakKeyDictionary[P2P, Callable[[str], None]]" = weakref.WeakKeyDictionary()


def observe_callers(p2p: P2P, observer: Callable[[str], None]) -> None:
    """`observer(peer_id)` after every RPC on `p2p` that a handler answered without error."""
    _CALLER_OBSERVERS[p2p] = observer


def _answered(p2p: P2P, peer: str) -> None:
    observer = _CALLER_OBSERVERS.get(p2p)
    if observer is not None:
        observer(peer)


def _error(message: str) -> BytesValue:
    return BytesValue(value=msgpack.packb({"error": message}))


async def serve_unary(
    p2p: P2P, name: str, handler: Callable[[M, str], Awaitable[BaseModel]], request_model: type[M]
) -> None:
    async def _handle(wrapper: BytesValue, context: P2PContext) -> BytesValue:
        peer = context.remote_id.to_base58()
        try:
            request = decode(wrapper, request_model)
        except RpcError as e:
            logger.info("refused %s from %s: %s", name.rsplit("/", 1)[-1], peer[-8:], e)
            return _error(str(e))
        try:
            reply = encode(await handler(request, peer))
            _answered(p2p, peer)
            return reply
        except asyncio.CancelledError:
            # The caller went away (its timeout; p2pd cancels this task). hivemind forgets a handler's task
            # only when it returns, so a cancelled one stayed in its table for good: a caller that times out
            # on every held request grew the daemon's memory without bound. Nobody reads this reply.
            return _error("cancelled: the caller went away")
        except Exception as e:
            logger.exception("%s handler failed", name)
            return _error(f"internal error: {type(e).__name__}")

    await p2p.add_protobuf_handler(name, _handle, BytesValue)


STREAM_TIMEOUT_S = 120.0  # a client stream's server side: the longest wait for its next message


async def serve_client_stream(
    p2p: P2P, name: str, handler: Callable[[AsyncIterator[M | RpcError], str], Awaitable[BaseModel]],
    request_model: type[M], timeout: float = STREAM_TIMEOUT_S,
) -> None:
    """The handler gets each streamed message decoded, or the RpcError that message caused.

    hivemind's framing (marker byte, 8-byte length, protobuf; an error marker ends the stream), on a
    binary stream of our own rather than hivemind's stream handler, for two reasons: each message's
    length is bounded before it is read, and the client closes first (see overlay/streams.py: p2pd
    resets a stream its handler side closes first, which over QUIC lost the reply)."""

    async def _handle(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()

        async def messages() -> AsyncIterator[M | RpcError]:
            while True:
                wrapper = await asyncio.wait_for(_receive(reader), timeout)
                if wrapper is None:  # end of stream
                    return
                try:
                    yield decode(wrapper, request_model)
                except RpcError as e:
                    yield e

        try:
            try:
                reply = encode(await handler(messages(), peer))
                _answered(p2p, peer)
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as e:
                logger.debug("%s stream from %s ended: %s", name, peer[-8:], type(e).__name__)
                return
            except RpcError as e:  # a frame over the limit: nothing more is read
                reply = _error(str(e))
            except Exception as e:
                logger.exception("%s handler failed", name)
                reply = _error(f"internal error: {type(e).__name__}")
            await P2P.send_protobuf(reply, writer)
            await asyncio.wait_for(_until_eof(reader), min(timeout, CLOSE_WAIT_S))
        except Exception as e:  # the caller left
            logger.debug("%s reply to %s: %s", name, peer[-8:], type(e).__name__)
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(name, _handle)


CLOSE_WAIT_S = 60.0


async def _receive(reader: asyncio.StreamReader) -> BytesValue | None:
    """One message of hivemind's framing, its length checked first; None at the end-of-stream marker."""
    marker = await reader.readexactly(1)
    size = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if size > MAX_MESSAGE_BYTES + 64:
        raise RpcError(f"message of {size} bytes exceeds the {MAX_MESSAGE_BYTES} byte limit")
    data = await reader.readexactly(size)
    if marker == P2P.ERROR_MARKER:
        error = RPCError()
        error.ParseFromString(data)
        if not error.message:
            return None
        raise RpcError(f"remote error: {error.message[:300]}")
    wrapper = BytesValue()
    wrapper.ParseFromString(data)
    return wrapper


async def _until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass


async def _call_unary(
    p2p: P2P, peer_id: str, name: str, request: BaseModel, response_models: tuple[type[BaseModel], ...], timeout: float
) -> BaseModel:
    try:
        wrapper = await asyncio.wait_for(
            p2p.call_protobuf_handler(PeerID.from_base58(peer_id), name, encode(request), BytesValue), timeout
        )
    except asyncio.TimeoutError:
        raise RpcError(f"{name.rsplit('/', 1)[-1]} to {peer_id[-8:]} timed out after {timeout:.0f} s") from None
    except RpcError:
        raise
    except Exception as e:  # hivemind raises P2PHandlerError, P2PDaemonError, ConnectionError ...
        raise RpcError(f"{name.rsplit('/', 1)[-1]} to {peer_id[-8:]} failed: {type(e).__name__}: {e}") from None
    return _decode_any(wrapper, response_models)


async def _call_client_stream(
    p2p: P2P, peer_id: str, name: str, requests: Sequence[BaseModel], response_models: tuple[type[BaseModel], ...],
    timeout: float,
) -> BaseModel:
    """Send `requests` on one stream, read the one reply, then close (first: see serve_client_stream)."""

    async def exchange() -> BytesValue | None:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
        try:
            for request in requests:
                await P2P.send_protobuf(encode(request), writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            return await _receive(reader)
        finally:
            writer.close()

    try:
        wrapper = await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        raise RpcError(f"{name.rsplit('/', 1)[-1]} to {peer_id[-8:]} timed out after {timeout:.0f} s") from None
    except RpcError:
        raise
    except Exception as e:
        raise RpcError(f"{name.rsplit('/', 1)[-1]} to {peer_id[-8:]} failed: {type(e).__name__}: {e}") from None
    if wrapper is None:
        raise RpcError(f"{name.rsplit('/', 1)[-1]} to {peer_id[-8:]}: no reply")
    return _decode_any(wrapper, response_models)


def _decode_any(wrapper: BytesValue, models: tuple[type[BaseModel], ...]) -> BaseModel:
    """Decode a reply that may be one of several models, told apart by their `kind` literal."""
    last: RpcError | None = None
    for model in models:
        try:
            return decode(wrapper, model)
        except RpcError as e:
            if str(e).startswith("remote error"):
                raise
            last = e
    raise last or RpcError("no reply model")


# -- surfaces (wire/surfaces.py): both ends derived from one declaration ----------------------------
async def serve(p2p: P2P, swarm: str, surface: Surface, servicer: object, *,
                stream_timeout: float = STREAM_TIMEOUT_S) -> None:
    """Answer every call of `surface` with `servicer.rpc_<verb>(request, peer)` (a client stream's
    handler gets an async iterator of the decoded messages, or the RpcError each caused).

    Every handler is checked before any is registered: a declared verb without an `rpc_<verb>`
    coroutine method taking (request, peer) is a TypeError here, at start, not a peer's failed call.
    """
    handlers = {rpc.verb: _handler(surface, rpc, servicer) for rpc in surface}
    for rpc in surface:
        name, handler = rpc_name(swarm, rpc.verb), _declared_replies(rpc, handlers[rpc.verb])
        if rpc.stream:
            await serve_client_stream(p2p, name, handler, rpc.request, stream_timeout)
        else:
            await serve_unary(p2p, name, handler, rpc.request)


def _handler(surface: Surface, rpc: Rpc, servicer: object) -> Callable[..., Awaitable[BaseModel]]:
    what = f"{type(servicer).__name__} serves the {surface.name} surface but"
    handler = getattr(servicer, rpc.handler, None)
    if handler is None:
        raise TypeError(f"{what} has no {rpc.handler} (wire/surfaces.py declares it)")
    if not inspect.iscoroutinefunction(handler):
        raise TypeError(f"{what} its {rpc.handler} is not an async method")
    try:
        inspect.signature(handler).bind(None, "peer")
    except TypeError:
        raise TypeError(f"{what} its {rpc.handler} does not take (request, peer)") from None
    return handler


def _declared_replies(rpc: Rpc, handler: Callable[..., Awaitable[BaseModel]]) -> Callable[..., Awaitable[BaseModel]]:
    """A handler that may answer only the declared replies (anything else: an internal error reply)."""

    async def checked(request: Any, peer: str) -> BaseModel:
        reply = await handler(request, peer)
        if not isinstance(reply, rpc.replies):
            raise TypeError(f"{rpc.handler} answered {type(reply).__name__}, which wire/surfaces.py does not declare")
        return reply

    return checked


class RpcStub:
    """Calls `surface` on one peer: a method per declared verb, which sends the declared request
    (a client stream: a sequence of them) and returns one of the declared replies, or raises RpcError.

        stub = RpcStub(overlay.p2p, swarm, LEARNER_RPC, learner)
        reply = await stub.lease(LeaseRequest(max_prompts=8), timeout=30)   # Lease | LeaseWait
    """

    def __init__(self, p2p: P2P, swarm: str, surface: Surface, peer_id: str):
        self.p2p, self.swarm, self.surface, self.peer_id = p2p, swarm, surface, peer_id
        for rpc in surface:
            if hasattr(self, rpc.verb):
                raise ValueError(f"the {surface.name} surface's verb {rpc.verb!r} shadows an RpcStub attribute")
            setattr(self, rpc.verb, functools.partial(self.call, rpc))

    async def call(self, rpc: Rpc, request: BaseModel | Sequence[BaseModel], *, timeout: float) -> BaseModel:
        """One call of `rpc` (the verb methods are this, bound); `timeout` covers the whole call."""
        if rpc not in self.surface.rpcs:
            raise ValueError(f"rpc_{rpc.verb} is not on the {self.surface.name} surface")
        if rpc.stream and isinstance(request, BaseModel):
            raise TypeError(f"{rpc.handler} streams a sequence of {rpc.request.__name__}, not one message")
        requests = list(request) if rpc.stream else [request]  # type: ignore[arg-type]
        wrong = sorted({type(r).__name__ for r in requests if not isinstance(r, rpc.request)})
        if wrong:
            raise TypeError(f"{rpc.handler} sends {rpc.request.__name__}, not {', '.join(wrong)}")
        name = rpc_name(self.swarm, rpc.verb)
        if rpc.stream:
            return await _call_client_stream(self.p2p, self.peer_id, name, requests, rpc.replies, timeout)
        return await _call_unary(self.p2p, self.peer_id, name, requests[0], rpc.replies, timeout)
