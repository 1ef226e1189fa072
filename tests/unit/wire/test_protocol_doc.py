"""docs/protocol.md and the code say the same: the example card, the card and daemon.json schemas, the
framing of a client stream. An implementer works from the doc alone, so a field the daemon writes and
the doc leaves out makes a strict parser refuse every card (issue 32)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import protocol_doc as doc

from echo2swarm.config.models import RolloutConfig
from echo2swarm.daemon.context import CardFields, DaemonContext
from echo2swarm.daemon.supervisor import Daemon
from echo2swarm.overlay.reachability import ReachabilityTracker
from echo2swarm.policy.pipeline import InFlight
from echo2swarm.policy.store import ChunkStore, VersionStore
from echo2swarm.wire.peer_keys import PeerKey
from echo2swarm.wire.records import Arrival, BanNote, PeerCard, VersionNote, parse_card
from echo2swarm.wire.signing import DOMAIN_CARD

SWARM = "demo"
NESTED = {"arrivals": ("`Arrival` fields", Arrival), "versions": ("`VersionNote` fields", VersionNote),
          "bans": ("`BanNote` fields", BanNote)}


def test_sections_are_numbered_in_order() -> None:
    numbers = [tuple(int(n) for n in number.split(".")) for number in doc.headings()]
    assert numbers == sorted(numbers), [".".join(map(str, n)) for n in numbers]
    assert len(set(numbers)) == len(numbers)


# -- §4.3: the example card and the schema tables ----------------------------------------------------
def _example() -> dict[str, Any]:
    blocks = doc.fenced(doc.section("4.3"), "json")
    assert len(blocks) == 1, "§4.3 holds one JSON example card"
    return json.loads(blocks[0])


def test_the_example_card_is_a_card_signed_by_the_documented_key() -> None:
    raw = _example()
    card = parse_card(raw)  # the strict schema a reader applies
    card.check_signature(SWARM)
    key = PeerKey(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))  # "the §3 seed"
    assert key.peer_id == card.peer_id
    unsigned = card.model_copy(update={"signature": "", "expires_ms": 0})
    assert unsigned.signed(key, SWARM, (card.expires_ms - card.updated_ms) / 1000) == card  # Ed25519 is deterministic
    signed_bytes = [b for b in doc.fenced(doc.section("4.3")) if b.startswith("echo2swarm/card/v1\n")]
    assert [b.encode() for b in signed_bytes] == [DOMAIN_CARD + card.signing_payload(SWARM) + b"\n"]
    size = re.search(r"(\d+)\s+msgpack bytes in the DHT", doc.section("4.3"))
    assert size is not None and int(size.group(1)) == len(msgpack.packb(card.model_dump(mode="json"), use_bin_type=True))
    assert not any(m.rstrip("/").split("/")[-2:-1] == ["p2p"] for m in card.maddrs), "real cards end in no /p2p/<id>"


class _Overlay:
    """The one thing Daemon.card and ready_info read of the overlay: our peer id."""

    def __init__(self, key: PeerKey):
        self.peer_id = key.peer_id

    def public_peers(self) -> list[str]:
        return []


class _Follower:
    """A role service as the supervisor sees it, with every optional card field set."""

    def card_fields(self) -> CardFields:
        return CardFields(
            version=7, state="syncing", fetching=8, arrival_s={6: 3.4123, 7: 0.98}, t_bcast_s=1.5,
            rollouts_per_s=4.2, active=True, bans={"12D3KooWA4Xop1JaT3MHxwYMkCepYsv4iPVopMXwCz5iHYdBfeSB": "malformed"},
            fetch_paths={6: ("keyframe", 35651584), 7: ("delta", 1245184)},
            published=[{"version": 7, "kind": "delta", "dense_bytes": 1 << 20, "delta_bytes": 4096}],
        )


def _daemon(tmp_path: Path, key: PeerKey) -> Daemon:
    config = RolloutConfig.model_validate({"overlay": {"new_swarm": True, "swarm": SWARM}, "state_dir": str(tmp_path),
                                           "price": 0.3, "upload_limit": 16 << 20})
    daemon = Daemon(config)
    overlay: Any = _Overlay(key)
    daemon.ctx = DaemonContext(overlay, ChunkStore(tmp_path), VersionStore(tmp_path), session=None,  # type: ignore[arg-type]
                               inflight=InFlight(), announcer=None)  # type: ignore[arg-type]
    daemon.service = _Follower()  # type: ignore[assignment]
    daemon.maddrs = [f"/ip4/10.0.0.5/tcp/41233/p2p/{key.peer_id}"]
    daemon.reach = ReachabilityTracker(overlay, config.overlay)
    daemon.reach.assume(["/ip4/10.0.0.5/tcp/41233", "/ip4/10.0.0.5/udp/41233/quic-v1"])
    daemon.http_url = daemon.chunk_url = "http://10.0.0.5:40123"
    return daemon


def test_the_card_tables_list_exactly_what_the_daemon_writes(tmp_path: Path) -> None:
    key = PeerKey.generate()
    card = _daemon(tmp_path, key).card()
    stored = card.signed(key, SWARM, 30).model_dump(mode="json")  # what Overlay.store_card puts in the DHT
    section = doc.section("4.3")
    assert doc.field_table(section, "`PeerCard` fields") == list(PeerCard.model_fields)
    assert set(doc.field_table(section, "`PeerCard` fields")) == set(stored)
    example = _example()
    assert list(example) == list(stored), "the example card has every field, in the daemon's order"
    for name, (caption, model) in NESTED.items():
        documented = doc.field_table(section, caption)
        assert stored[name], f"the daemon's card has no {name} to compare with"
        assert documented == list(model.model_fields) == list(stored[name][0]), name
        for entry in example[name]:
            assert list(entry) == documented, f"an example {name} entry lacks a field"


# -- §8.1: daemon.json ---------------------------------------------------------------------------------
def test_daemon_json_table_lists_exactly_what_the_supervisor_writes(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, PeerKey.generate())
    daemon._write_ready_file()
    written = json.loads((tmp_path / "daemon.json").read_text())
    assert written == daemon.ready_info()
    assert doc.field_table(doc.section("8.1"), "`daemon.json` fields") == list(written)
    assert written["reachability"] == daemon.reach.state and written["card_maddrs"] == daemon.card().maddrs  # type: ignore[union-attr]


# -- §10.1: framing a client stream --------------------------------------------------------------------
def _framing_example() -> tuple[bytes, bytes, bytes]:
    body = doc.section("10.1")
    frames = [doc.hex_bytes(b) for b in doc.fenced(body) if re.fullmatch(r"[0-9a-f ]+", " ".join(b.split()))]
    assert len(frames) == 3, "§10.1's example: a request frame, END_OF_STREAM, the reply frame"
    return frames[0], frames[1], frames[2]


def _documented_submission() -> Any:
    from echo2swarm.wire.work import CompletionMsg, GroupSubmission

    return GroupSubmission(lease_id="9f86d081884c7d65", prompt_id="train:7", version=3, generation_s=0.5,
                           completions=[CompletionMsg(token_ids=[17, 2], logprobs=[-0.25, -1.5], finish_reason="stop")])


def test_the_framing_example_is_what_the_caller_writes_and_the_learner_reads() -> None:
    from hivemind.p2p import P2P

    from echo2swarm.overlay.rpc import _receive, decode, encode
    from echo2swarm.wire.work import GroupSubmission, SubmitResult

    request, end, reply = _framing_example()

    class Sink:
        def __init__(self) -> None:
            self.data = bytearray()

        def write(self, data: bytes) -> None:
            self.data += bytes(data)

        async def drain(self) -> None:
            pass

    async def written(message: Any) -> bytes:
        sink = Sink()
        await P2P.send_protobuf(message, sink)  # type: ignore[arg-type]
        return bytes(sink.data)

    async def read(data: bytes) -> list[Any]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        out = []
        while not reader.at_eof():
            out.append(await _receive(reader))
        return out

    async def check() -> None:
        submission = _documented_submission()
        assert await written(encode(submission)) == request
        assert await written(P2P.END_OF_STREAM) == end
        assert await written(encode(SubmitResult(accepted=1))) == reply
        first, eos = await read(request + end)
        assert decode(first, GroupSubmission) == submission and eos is None
        (answer,) = await read(reply)
        assert decode(answer, SubmitResult) == SubmitResult(accepted=1)

    asyncio.run(check())


@pytest.mark.parametrize("verb", ["lease", "submit", "dialback"])
def test_the_transport_section_names_every_declared_call(verb: str) -> None:
    from echo2swarm.wire.surfaces import DIALBACK_RPC, LEARNER_RPC

    rpc = {r.verb: r for r in [*LEARNER_RPC, *DIALBACK_RPC]}[verb]
    body = doc.section("10.1")
    row = "client stream" if rpc.stream else "unary"
    assert re.search(rf"^\| {row} \([^)]*`rpc_{verb}`", body, re.M), f"§10.1 lists rpc_{verb} under {row}"
