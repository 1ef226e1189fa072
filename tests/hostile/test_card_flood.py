"""2,000 validly signed cards from fresh keys must not hide the peers that do the swarm's work.

Seen on main before: every card lived under one DHT key that comes back as one reply (hivemind caps
it at 4 MiB), so a flood truncated it: `echo2swarm peers --json` exited 2 listing none of the
honest peers, the delivering rollout peer was not in the learner's broadcast plan, and a fresh key
that got a `LeaseWait` answer counted as "seen working" and, claiming an uncapped uplink, headed
the plan's chains.

Now each card is also stored under its own key, the learner publishes a signed roster of the
peers it has seen doing work (docs/protocol.md §4.9), and readers read those first. The rogue
here is a real hivemind DHT node in this process (no validator of its own, so it sends the exact
bytes it wants) plus one RogueWorker that asks the learner for work; the honest daemons
(bootstrap, learner, one paced rollout peer) are separate processes on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.rogue import RogueWorker, training_swarm
from helpers.swarm import LocalSwarm, http_json, read_metrics, run_cli, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(360)]
FLOOD = 2000
BATCH = 100
STORE_TIMEOUT_S = 30.0
WINDOW_STEPS = 8  # steps per step-rate window, before and during the flood


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rate(rows: list[dict[str, Any]]) -> float:
    """Steps per second over `rows` (consecutive metrics rows)."""
    return (len(rows) - 1) / max(1e-9, rows[-1]["time_s"] - rows[0]["time_s"])


async def _flood(bootstrap: str, swarm: str, version: int, count: int) -> int:
    """Store `count` cards, each signed by a fresh key, as large as a card may plausibly be: every
    one claims an uncapped uplink, price 0, a huge µ and the versions the learner published."""
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P

    from echo2swarm.overlay.dht_keys import peers_key
    from echo2swarm.wire.peer_keys import PeerKey
    from echo2swarm.wire.records import Arrival, PeerCard

    p2p = await asyncio.wait_for(P2P.create(initial_peers=[bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"]), 60)
    node = await asyncio.wait_for(DHTNode.create(p2p=p2p, initial_peers=[bootstrap], client_mode=True), 60)
    key = peers_key(swarm)
    held = list(range(max(1, version - 31), version + 1))
    try:
        async def one() -> bool:
            fake = PeerKey.generate()
            now_ms = int(time.time() * 1000)
            card = PeerCard(
                peer_id=fake.peer_id, role="rollout", price=0.0, state="ready", software="0.1.0",
                version=version, held=held, rollouts_per_s=1e7, reachability="public",
                maddrs=[f"/ip4/127.0.0.{i + 2}/tcp/{40000 + i}/p2p/{fake.peer_id}" for i in range(4)],
                arrivals=[Arrival(version=v, seconds=0.01) for v in held[-8:]], updated_ms=now_ms,
            ).signed(fake, swarm, 300.0)
            return bool(await asyncio.wait_for(
                node.store(key, card.model_dump(mode="json"), time.time() + 300.0, subkey=fake.peer_id),
                STORE_TIMEOUT_S))

        stored = 0
        for _ in range(0, count, BATCH):  # one client, many keys
            stored += sum(await asyncio.gather(*(one() for _ in range(BATCH)), return_exceptions=False))
        return stored
    finally:
        await node.shutdown()
        await p2p.shutdown()


def test_a_flood_of_fresh_signed_cards_hides_no_delivering_peer(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
):
    learner, honest, info, metrics = training_swarm(local_swarm, tiny_model_dir, policy_key, tmp_path, steps_first=3)
    addr, swarm = local_swarm.bootstrap_addr, local_swarm.swarm
    assert addr is not None
    learner_id, honest_id = learner.info["peer_id"], honest.info["peer_id"]
    wait_until(lambda: len(read_metrics(metrics)) >= 3 + WINDOW_STEPS, 120, what="a step-rate window before the flood")
    before = read_metrics(metrics)
    rate_before = _rate(before[-WINDOW_STEPS - 1:])
    rss_before = _rss_mb(learner.pid)

    async def attack() -> tuple[int, int]:
        # A fresh identity with an uncapped card asks for work: whatever it is answered must not make
        # it a peer "seen working" that heads the plan ahead of the one that delivers.
        async with RogueWorker(addr, swarm, learner_id) as rogue:
            assert await rogue.announce()
            await rogue.lease(max_prompts=8)
            stored = await _flood(addr, swarm, http_json(info)["version"], FLOOD)
            await rogue.lease(max_prompts=8)
            return stored, len(read_metrics(metrics))

    stored, steps_at_flood = asyncio.run(asyncio.wait_for(attack(), 240))
    assert stored >= FLOOD * 0.9, f"only {stored} of {FLOOD} flood cards were stored"
    version_at_flood = http_json(info)["version"]

    # `peers` reads through the flood: it lists the learner and the delivering rollout peer.
    def listed() -> dict[str, Any] | None:
        result = run_cli("peers", "--initial-peers", addr, "--swarm", swarm, "--json", timeout=90)
        if result.returncode != 0:
            listed.last = f"exit {result.returncode}: {result.stderr[-400:]}"  # type: ignore[attr-defined]
            return None
        peers = {p["peer_id"]: p for p in json.loads(result.stdout)}
        listed.last = f"{len(peers)} peers, learner {learner_id in peers}, rollout {honest_id in peers}"  # type: ignore[attr-defined]
        return peers if learner_id in peers and honest_id in peers else None

    listed.last = ""  # type: ignore[attr-defined]
    try:
        peers = wait_until(listed, 120, interval=1.0, what="peers --json to list the learner and the rollout peer")
    except TimeoutError as e:
        raise AssertionError(f"{e}; last try: {listed.last}") from None  # type: ignore[attr-defined]
    assert peers[learner_id]["chunk_url"] == learner.info["chunk_url"]

    # The learner's broadcast plan of a version published after the flood covers the delivering peer,
    # ahead of every peer that never delivered (the flood's and the rogue's).
    def plan_after_flood() -> dict[str, Any] | None:
        version = http_json(info)["version"]
        if version < version_at_flood + 2:
            return None
        plan = http_json(f"{learner.info['chunk_url']}/v1/plan/{version}")
        plan_after_flood.last = plan  # type: ignore[attr-defined]
        return plan if any(honest_id in chain for chain in plan["stripes"]) else None

    plan_after_flood.last = None  # type: ignore[attr-defined]
    try:
        plan = wait_until(plan_after_flood, 120, interval=0.5, what="a plan after the flood that covers the rollout peer")
    except TimeoutError as e:
        last = plan_after_flood.last  # type: ignore[attr-defined]
        raise AssertionError(f"{e}; last plan: {None if last is None else [len(c) for c in last['stripes']]} "
                             f"peers per stripe, rollout peer absent") from None
    assert plan["publisher"] == learner_id
    # Chains order the peers alike, each stripe headed by the next one (policy/broadcast_plan.py).
    assert plan["stripes"][0][0] == honest_id, f"a peer that never delivered comes first: {plan['stripes'][0][:3]}"
    assert all(chain.index(honest_id) <= 1 for chain in plan["stripes"]), [c[:3] for c in plan["stripes"]]

    # The learner keeps at least half its step rate with the flood's cards alive (they live 300 s).
    wait_until(lambda: len(read_metrics(metrics)) >= steps_at_flood + WINDOW_STEPS + 1, 150,
               what="a step-rate window during the flood")
    during = read_metrics(metrics)[steps_at_flood - 1:]
    rate_during = _rate(during)
    rss_during = _rss_mb(learner.pid)
    print(f"step rate {rate_before:.2f} -> {rate_during:.2f} steps/s; learner RSS {rss_before:.0f} -> {rss_during:.0f} MB")
    assert rate_during >= 0.5 * rate_before, (rate_before, rate_during)
    assert rss_during <= rss_before + 150, f"learner RSS {rss_before:.0f} -> {rss_during:.0f} MB under the flood"
    assert learner.running() and honest.running()
