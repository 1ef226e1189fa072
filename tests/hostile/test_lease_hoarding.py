"""A client that takes leases and never submits must not starve the honest peers.

Seen on main before: one client polling for leases and never submitting took 204 prompts while an
honest peer got 8. Now a newcomer holds only its probation share until it delivers, its lapsed
leases count against it, and it is banned after `peers.ban_after_lapsed_leases` lapses in a row.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers.rogue import RogueWorker, training_swarm
from helpers.swarm import LocalSwarm, http_json, read_metrics, wait_until

from echo2swarm.wire.work import Lease

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


@pytest.mark.slow
def test_a_lease_hoarder_gets_its_probation_share_and_is_banned_after_lapses(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
):
    # A short window: the hoarder may take its probation share again soon after a lapse, and lapse again.
    learner, _, info, metrics = training_swarm(
        local_swarm, tiny_model_dir, policy_key, tmp_path, steps_first=12,
        env={"ECHO2SWARM_PEERS__BAN_AFTER_LAPSED_LEASES": "2", "ECHO2SWARM_PEERS__WINDOW_S": "6"},
    )
    delivered_before = http_json(info)["stats"]["accepted"]
    before = read_metrics(metrics)

    async def hoard() -> tuple[int, int, str]:
        taken = asks = 0
        async with RogueWorker(local_swarm.bootstrap_addr, local_swarm.swarm, learner.info["peer_id"]) as rogue:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 90  # two 5 s lease timeouts and then some, on a busy machine
            while loop.time() < deadline:
                reply = await rogue.lease(max_prompts=8)
                asks += 1
                if isinstance(reply, Lease):
                    taken += len(reply.prompts)
                elif reply.done:
                    return taken, asks, reply.reason
                await asyncio.sleep(0.05)  # poll interval: a hoarder asks as often as it may
        return taken, asks, ""

    taken, asks, last_reason = asyncio.run(hoard())
    during = read_metrics(metrics)[len(before):]
    assert "banned" in last_reason and "lapsed" in last_reason, last_reason
    assert asks > 20 and taken <= 2 * 2, f"the hoarder took {taken} prompts in {asks} requests"  # probation, twice
    stats = http_json(info)["stats"]
    assert stats["leases"]["leases_expired"] >= 2
    assert stats["accepted"] > delivered_before, "the honest peer kept delivering during the hoarding"
    # The learner keeps at least half its step rate while the hoarder is at work.
    rate_before = (len(before) - 3) / (before[-1]["time_s"] - before[2]["time_s"])
    rate_during = len(during) / (during[-1]["time_s"] - before[-1]["time_s"])
    assert rate_during >= 0.5 * rate_before, (rate_before, rate_during)
    steps = len(read_metrics(metrics))
    wait_until(lambda: len(read_metrics(metrics)) >= steps + 3, 120, what="training to go on after the ban")
