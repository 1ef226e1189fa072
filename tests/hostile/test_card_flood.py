"""2,000 validly signed cards from fresh keys must not hide the peers that do the swarm's work.

Seen on main before: every card lived under one DHT key that comes back as one reply (hivemind caps
it at 4 MiB), so a flood failed or truncated it: `echo2swarm peers --json` exited 2 listing none of
the honest peers, the delivering rollout peer was not in the learner's broadcast plan, and a fresh
key that got a `LeaseWait` answer counted as "seen working" and, claiming an uncapped uplink,
headed the plan's chains.

Now each card is also stored under its own key, the learner publishes a signed roster of the
peers it saw delivering (docs/protocol.md §4.9), readers read those first, and asking for work
proves nothing. The rogues here: a raw hivemind DHT node in this process (no validator of its own,
so it sends the exact bytes it wants) that stores the flood on every honest DHT node, and a fresh
identity that keeps asking the learner for work. The honest daemons (bootstrap, learner, one paced
rollout peer) are separate processes on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.rogue import training_swarm
from helpers.swarm import LocalSwarm, http_json, read_metrics, run_cli, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(360)]
FLOOD = 2000
BATCH = 50  # cards per store request (~330 KB: within hivemind's unary message cap)
WINDOW_STEPS = 8  # steps per step-rate window, before and during the flood


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds `pid` has used (diagnostics: the machine may be shared)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rate(rows: list[dict[str, Any]]) -> float:
    """Steps per second over `rows` (consecutive metrics rows)."""
    return (len(rows) - 1) / max(1e-9, rows[-1]["time_s"] - rows[0]["time_s"])


def _fake_card(swarm: str, version: int) -> tuple[str, dict[str, Any]]:
    """A card signed by a fresh key, about as large as a card may be (~6.5 KB of the 10 KiB allowed): it
    claims an uncapped uplink, price 0, a huge µ and every version the learner published."""
    from echo2swarm.wire.peer_keys import PeerKey
    from echo2swarm.wire.records import Arrival, BanNote, PeerCard, VersionNote

    fake = PeerKey.generate()
    held = list(range(max(1, version - 31), version + 1))
    card = PeerCard(
        peer_id=fake.peer_id, role="rollout", price=0.0, state="ready", software="0.1.0",
        version=version, held=held, rollouts_per_s=1e7, reachability="public",
        maddrs=[f"/dns4/{'x' * 150}.example/tcp/{40000 + i}/p2p/{fake.peer_id}" for i in range(8)],
        arrivals=[Arrival(version=v, seconds=0.01, path="keyframe", fetched_bytes=1) for v in held[-8:]],
        bans=[BanNote(peer_id=fake.peer_id, reason="r" * 120) for _ in range(16)],
        versions=[VersionNote(version=v, kind="dense", dense_bytes=1) for v in held[-8:]],
        updated_ms=int(time.time() * 1000),
    ).signed(fake, swarm, 300.0)
    return fake.peer_id, card.model_dump(mode="json")


async def _flood(bootstrap: str, swarm: str, version: int, nodes: dict[str, str], count: int) -> dict[str, list[int]]:
    """Offer `count` fresh cards under the shared peers key to every honest DHT node (`nodes`: peer id ->
    multiaddr), straight to each, so none is spared; per node, [batches answered, cards it took]."""
    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr
    from hivemind.utils.serializer import MSGPackSerializer

    from echo2swarm.overlay.dht_keys import peers_key

    p2p = await asyncio.wait_for(P2P.create(initial_peers=[bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"]), 60)
    node = await asyncio.wait_for(DHTNode.create(p2p=p2p, initial_peers=[bootstrap], client_mode=True, wait_timeout=30), 60)
    key = DHTID.generate(source=peers_key(swarm))
    stored = {peer: [0, 0] for peer in nodes}
    try:
        for peer, maddr in nodes.items():
            await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(maddr.rsplit("/p2p/", 1)[0])]), 30)
        expires = time.time() + 300.0
        for _ in range(0, count, BATCH):
            cards = [_fake_card(swarm, version) for _ in range(BATCH)]
            values = [MSGPackSerializer.dumps(card) for _, card in cards]
            subkeys = [peer_id for peer_id, _ in cards]
            replies = await asyncio.gather(*(asyncio.wait_for(node.protocol.call_store(
                PeerID.from_base58(peer), [key] * BATCH, values, expires, subkeys=subkeys), 60) for peer in nodes))
            for peer, reply in zip(nodes, replies):
                stored[peer][0] += reply is not None
                stored[peer][1] += sum(reply or [])
        return stored
    finally:
        await node.shutdown()
        await p2p.shutdown()


class _Asker:
    """A fresh identity whose peer id sorts before `below` (so a tie in the plan's ranking goes its way)
    that announces a card claiming an uncapped uplink and asks the learner for work every second, with
    a held version too old to be given any (so it is answered `LeaseWait`, never leased, never banned)."""

    def __init__(self, addr: str, swarm: str, learner: str, below: str, key_dir: Path):
        from echo2swarm.wire.peer_keys import PeerKey

        key = PeerKey.generate()
        while key.peer_id >= below:
            key = PeerKey.generate()
        self.peer_id = key.peer_id
        self.identity = key_dir / "asker.key"
        key.save(self.identity)
        self.addr, self.swarm, self.learner = addr, swarm, learner
        self.answers = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        from echo2swarm.config.models import OverlayConfig
        from echo2swarm.overlay.node import Overlay
        from echo2swarm.overlay.rpc import RpcStub
        from echo2swarm.wire.records import PeerCard
        from echo2swarm.wire.surfaces import LEARNER_RPC
        from echo2swarm.wire.work import LeaseRequest, LeaseWait

        try:
            config = OverlayConfig(swarm=self.swarm, initial_peers=[self.addr], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                   identity=str(self.identity), record_ttl_s=4.0, announce_period_s=1.0)
            overlay = await Overlay.start(config)
            stub = RpcStub(overlay.p2p, self.swarm, LEARNER_RPC, self.learner)
            try:
                while not self._stop.is_set():
                    card = PeerCard(peer_id=self.peer_id, role="rollout", price=0.0, state="ready", software="0.1.0",
                                    rollouts_per_s=1e7, reachability="public", updated_ms=int(time.time() * 1000))
                    await overlay.store_card(card)
                    reply = await stub.lease(LeaseRequest(max_prompts=8, held_version=0), timeout=10)
                    assert isinstance(reply, LeaseWait), reply
                    self.answers += 1
                    await asyncio.sleep(1.0)
            finally:
                await overlay.stop()
        except BaseException as e:  # reported by the test
            self.error = e

    def __enter__(self) -> "_Asker":
        self._thread.start()
        wait_until(lambda: self.answers or self.error, 60, what="the asker's first answer from the learner")
        assert self.error is None, self.error
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.mark.slow
def test_a_flood_of_fresh_signed_cards_hides_no_delivering_peer(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
):
    learner, honest, info, metrics = training_swarm(local_swarm, tiny_model_dir, policy_key, tmp_path, steps_first=3)
    addr, swarm = local_swarm.bootstrap_addr, local_swarm.swarm
    assert addr is not None
    learner_id, honest_id = learner.info["peer_id"], honest.info["peer_id"]
    steps_first, cpu_first = len(read_metrics(metrics)), _cpu_s(learner.pid)
    wait_until(lambda: len(read_metrics(metrics)) >= steps_first + WINDOW_STEPS, 120,
               what="a step-rate window before the flood")
    before = read_metrics(metrics)
    rate_before = _rate(before[steps_first - 1:])
    cpu_before = (_cpu_s(learner.pid) - cpu_first) / (len(before) - steps_first)
    rss_before = _rss_mb(learner.pid)

    with _Asker(addr, swarm, learner_id, below=honest_id, key_dir=tmp_path) as asker:
        nodes = {d.info["peer_id"]: d.maddr for d in local_swarm.daemons}
        stored = asyncio.run(asyncio.wait_for(_flood(addr, swarm, http_json(info)["version"], nodes, FLOOD), 240))
        assert all(answered == FLOOD // BATCH for answered, _ in stored.values()), f"flood batches answered: {stored}"
        print(f"flood cards each node took: {sorted(took for _, took in stored.values())}")
        version_at_flood = http_json(info)["version"]

        # `peers` reads through the flood: it lists the learner and the delivering rollout peer.
        last = {"peers": ""}

        def listed() -> dict[str, Any] | None:
            result = run_cli("peers", "--initial-peers", addr, "--swarm", swarm, "--json", timeout=90)
            if result.returncode != 0:
                last["peers"] = f"exit {result.returncode}: {result.stderr[-400:]}"
                return None
            peers = {p["peer_id"]: p for p in json.loads(result.stdout)}
            last["peers"] = (f"{len(peers)} peers, learner {learner_id in peers}, rollout {honest_id in peers}; "
                             f"stderr: {result.stderr[-600:]}")
            return peers if learner_id in peers and honest_id in peers else None

        try:
            peers = wait_until(listed, 120, interval=1.0, what="peers --json to list the learner and the rollout peer")
        except TimeoutError as e:
            raise AssertionError(f"{e}; last try: {last['peers']}") from None
        assert peers[learner_id]["chunk_url"] == learner.info["chunk_url"]
        assert "delivered" in peers[honest_id]["work"] and "published" in peers[learner_id]["work"]
        rollouts = [p["peer_id"] for p in peers.values() if p["role"] == "rollout"]  # in the order listed
        assert rollouts[0] == honest_id, "peers lists the delivering peer first among the rollout peers"

        # The learner's plan of a version published after the flood covers the delivering peer, ahead of
        # every peer that never delivered: the flood's and the asker's (answered, uncapped, sorting first).
        def plan_after_flood() -> dict[str, Any] | None:
            version = http_json(info)["version"]
            if version < version_at_flood + 2:
                return None
            plan = http_json(f"{learner.info['chunk_url']}/v1/plan/{version}")
            last["plan"] = plan
            return plan if any(honest_id in chain for chain in plan["stripes"]) else None

        try:
            plan = wait_until(plan_after_flood, 120, interval=0.5, what="a plan after the flood covering the rollout peer")
        except TimeoutError as e:
            stripes = last.get("plan", {}).get("stripes")  # type: ignore[union-attr]
            raise AssertionError(f"{e}; last plan's chains: {[c[:3] for c in stripes or []]}") from None
        assert plan["publisher"] == learner_id
        assert asker.answers >= 2
        # Chains order the peers alike, each stripe headed by the next one (policy/broadcast_plan.py).
        assert plan["stripes"][0][0] == honest_id, f"a peer that never delivered comes first: {plan['stripes'][0][:3]}"
        assert all(chain.index(honest_id) <= 1 for chain in plan["stripes"]), [c[:3] for c in plan["stripes"]]

    # The learner keeps at least half its step rate with the flood's cards alive (they live 300 s),
    # measured after the checks above (their own CLI runs are not the attack).
    steps_at_checks, cpu_at_checks = len(read_metrics(metrics)), _cpu_s(learner.pid)
    wait_until(lambda: len(read_metrics(metrics)) >= steps_at_checks + WINDOW_STEPS, 150,
               what="a step-rate window during the flood")
    during = read_metrics(metrics)[steps_at_checks - 1:]
    rate_during = _rate(during)
    cpu_during = (_cpu_s(learner.pid) - cpu_at_checks) / (len(during) - 1)
    rss_during = _rss_mb(learner.pid)
    print(f"step rate {rate_before:.2f} -> {rate_during:.2f} steps/s; learner CPU {cpu_before:.2f} -> "
          f"{cpu_during:.2f} s/step; learner RSS {rss_before:.0f} -> {rss_during:.0f} MB")
    assert rate_during >= 0.5 * rate_before, (rate_before, rate_during)
    assert rss_during <= rss_before + 100, f"learner RSS {rss_before:.0f} -> {rss_during:.0f} MB under the flood"
    assert learner.running() and honest.running()
