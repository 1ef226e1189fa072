"""RPC surfaces (wire/surfaces.py) served and called through overlay/rpc.py: a server missing a
declared handler does not start, stubs and servers agree over a real libp2p pair, and no module
but the declaration spells a verb or a reply type."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

import echo2swarm
from echo2swarm.overlay.reachability import probe, serve_dialback
from echo2swarm.overlay.rpc import RpcError, RpcStub, serve
from echo2swarm.wire.surfaces import LEARNER_RPC, Rpc, Surface
from echo2swarm.wire.work import GroupSubmission, Lease, LeaseRequest, LeaseWait, SubmitResult
from helpers.intake import answer_ids, completion, make_intake
from helpers.overlays import overlay_pair

pytestmark = pytest.mark.timeout(120)


class Ping(BaseModel):
    n: int


class Pong(BaseModel):
    kind: Literal["pong"] = "pong"
    n: int


class Busy(BaseModel):
    kind: Literal["busy"] = "busy"


class Total(BaseModel):
    total: int


DEMO = Surface("demo", (
    Rpc("ping", Ping, (Pong, Busy)),
    Rpc("sum", Ping, (Total,), stream=True),
    Rpc("rude", Ping, (Pong,)),  # its handler answers an undeclared type
))


class Demo:
    def __init__(self) -> None:
        self.callers: list[str] = []

    async def rpc_ping(self, request: Ping, peer: str) -> Pong | Busy:
        self.callers.append(peer)
        return Pong(n=request.n + 1) if request.n >= 0 else Busy()

    async def rpc_sum(self, requests: AsyncIterator[Ping | RpcError], peer: str) -> Total:
        return Total(total=sum([r.n async for r in requests if not isinstance(r, RpcError)]))

    async def rpc_rude(self, request: Ping, peer: str) -> Total:
        return Total(total=0)


class NoSum:
    async def rpc_ping(self, request: Ping, peer: str) -> Pong:
        return Pong(n=0)


class SyncSum(NoSum):
    def rpc_sum(self, requests: object, peer: str) -> Total:
        return Total(total=0)


class OneArgSum(NoSum):
    async def rpc_sum(self, requests: object) -> Total:
        return Total(total=0)


@pytest.mark.parametrize("servicer, complaint", [
    (NoSum(), "NoSum serves the demo surface but has no rpc_sum"),
    (SyncSum(), "its rpc_sum is not an async method"),
    (OneArgSum(), "its rpc_sum does not take (request, peer)"),
])
def test_a_declared_verb_without_a_handler_is_refused_at_serve_time(servicer: object, complaint: str) -> None:
    # Checked before anything is registered: p2p is never touched (None would fail differently).
    with pytest.raises(TypeError, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        asyncio.run(serve(None, "demo", DEMO, servicer))  # type: ignore[arg-type]


def test_declarations_refuse_what_a_receiver_could_not_tell_apart() -> None:
    with pytest.raises(ValueError, match="distinct `kind` literals"):
        Rpc("ping", Ping, (Pong, Total))
    with pytest.raises(ValueError, match="declares a verb twice"):
        Surface("twice", (Rpc("ping", Ping, (Pong,)), Rpc("ping", Ping, (Busy,))))
    assert LEARNER_RPC.verbs == ("lease", "submit") and LEARNER_RPC["submit"].stream


def test_stubs_and_servers_derived_from_one_declaration_agree_over_libp2p() -> None:
    async def scenario() -> None:
        async with overlay_pair("surf") as (a, b):
            demo = Demo()
            await serve(a.p2p, "surf", DEMO, demo)
            stub = RpcStub(b.p2p, "surf", DEMO, a.peer_id)
            assert await stub.ping(Ping(n=1), timeout=10) == Pong(n=2)
            assert await stub.ping(Ping(n=-1), timeout=10) == Busy()
            assert await stub.sum([Ping(n=2), Ping(n=3)], timeout=10) == Total(total=5)
            with pytest.raises(RpcError, match="remote error: internal error: TypeError"):
                await stub.rude(Ping(n=0), timeout=10)
            with pytest.raises(TypeError, match="rpc_ping sends Ping, not Total"):
                await stub.ping(Total(total=1), timeout=10)
            with pytest.raises(TypeError, match="rpc_sum streams a sequence of Ping"):
                await stub.sum(Ping(n=1), timeout=10)
            assert demo.callers == [b.peer_id, b.peer_id]  # the id libp2p authenticated
            # An answered caller asked for work (its card is read by name), but asking is not working.
            assert b.peer_id in a.work.asked() and b.peer_id not in a.worked()

            # The learner's surface, served from a real Intake as the learner serves it.
            intake = make_intake(staleness=1, prompts_per_step=2)  # capacity 4 prompts: two leases of 2
            await serve(a.p2p, "surf", LEARNER_RPC, intake)
            learner = RpcStub(b.p2p, "surf", LEARNER_RPC, a.peer_id)
            request = LeaseRequest(max_prompts=2, held_version=5)
            replies = [await learner.lease(request, timeout=10) for _ in range(3)]
            assert [type(r) for r in replies] == [Lease, Lease, LeaseWait]
            lease = replies[0]
            groups = [GroupSubmission(lease_id=lease.lease_id, prompt_id=p.prompt_id, version=5, generation_s=0.1,
                                      completions=[completion(answer_ids("0"))] * lease.sampling.n)
                      for p in lease.prompts]
            result = await learner.submit(groups, timeout=10)
            assert result == SubmitResult(accepted=2) and intake.delivered[b.peer_id] == 2

            # The dial-back surface, both sides (overlay/reachability.py).
            service = await serve_dialback(a)
            found = await probe(b, [a.peer_id], [], None)
            assert found.responder == a.peer_id and found.reply is not None and found.reply.observed == "127.0.0.1"
            assert service.stats["answered"] == 1

    asyncio.run(scenario())


# -- one declaration: nothing outside it names a verb or a reply type for the transport --------------
ROOT = Path(echo2swarm.__file__).parent
REPO = ROOT.parent
DECLARATION = ROOT / "wire" / "surfaces.py"
TRANSPORT = ROOT / "overlay" / "rpc.py"
# What takes a verb or reply types by hand; only the transport calls these, with a declared Rpc's fields.
LOW_LEVEL = {"rpc_name", "serve_unary", "serve_client_stream", "_call_unary", "_call_client_stream",
             "add_protobuf_handler", "call_protobuf_handler"}


def _calls(path: Path, names: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    return found


def test_only_the_declaration_spells_verbs_and_reply_types() -> None:
    sources = [*ROOT.rglob("*.py"), *(REPO / "scripts").glob("*.py"), *(REPO / "tests" / "helpers").glob("*.py")]
    by_hand = [c for path in sources if path != TRANSPORT for c in _calls(path, LOW_LEVEL)]
    assert by_hand == []
    declared = [c for path in sources if path != DECLARATION for c in _calls(path, {"Rpc", "Surface"})]
    assert declared == []
