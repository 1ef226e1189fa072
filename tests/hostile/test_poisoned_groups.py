"""Crafted groups must never reach the weights: absurd logprobs and fabricated answers.

Seen on main before: one group with finite but absurd behaviour logprobs (-1e30) made the loss
inf/NaN, clip_grad_norm_ spread NaN into every weight and the learner signed an all-NaN version;
a worker running no model, sending the right answer digits with a constant logprob, had its groups
trained on. Here a real learner and a real rollout peer train while two rogue workers (plain libp2p
peers speaking the lease/submit RPCs) each try one of these; the learner must refuse their groups,
ban both, keep every metric finite, publish only finite weights, and keep training the honest peer.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest
from helpers.rogue import RogueWorker, right_answer_ids, training_swarm
from helpers.swarm import LocalSwarm, http_json, peers_json, read_metrics, wait_until

from safetensors.numpy import load_file

from echo2swarm.policy.store import VersionStore
from echo2swarm.wire.work import CompletionMsg, Lease

# 900 s: the first test of a session to ask for warm_model_dir builds it (minutes on a busy 2-core box).
pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]


def _banned(info_url: str) -> dict[str, str]:
    return http_json(info_url)["stats"].get("peers", {}).get("banned", {})


async def _attack(rogue: RogueWorker, craft) -> tuple[Lease, int]:
    lease = await rogue.lease_until_granted(timeout=60)
    assert isinstance(lease, Lease), f"the rogue never got work: {lease}"
    version = json.loads(lease.head)["version"] if lease.head else lease.min_version
    result = await rogue.submit(lease, version, craft)
    return lease, result.accepted


@pytest.mark.slow
def test_absurd_and_fabricated_logprobs_are_refused_and_their_senders_banned(
    local_swarm: LocalSwarm, warm_model_dir: Path, policy_key: Path, tmp_path: Path
):
    learner, honest, info, metrics = training_swarm(local_swarm, warm_model_dir, policy_key, tmp_path)
    answer = right_answer_ids(warm_model_dir)

    def absurd(prompt, n):  # finite, <= 0: passes every shape check, poisons an unchecked loss
        ids = answer(prompt)
        return [CompletionMsg(token_ids=ids, logprobs=[-1e30] * len(ids), finish_reason="stop")] * n

    def fabricated(prompt, n):  # the right answer with a made-up constant logprob, no model run
        # -3 nats a token: wrong by more than the exact tolerance (1 nat) whatever the policy now gives
        # the right answer. A constant close to the truth (-0.05 once the policy is confident) is within
        # tolerance and harmless (docs/protocol.md §13): it says what the policy says.
        ids = answer(prompt)
        return [CompletionMsg(token_ids=ids, logprobs=[-3.0] * len(ids), finish_reason="stop")] * n

    async def attacks() -> list[tuple[str, int]]:
        out = []
        for craft in (absurd, fabricated):
            async with RogueWorker(local_swarm.bootstrap_addr, local_swarm.swarm, learner.info["peer_id"]) as rogue:
                assert await rogue.announce()  # a free card claiming a huge rate, to be seen banned in `peers`
                _, accepted = await _attack(rogue, craft)
                out.append((rogue.peer_id, accepted))
                # Verification runs when the groups train: wait for the ban while the rogue stays connected.
                # That is when a step's batch fills with the honest peer's groups: minutes on a loaded host.
                await asyncio.to_thread(wait_until, lambda: rogue.peer_id in _banned(info), 300,
                                        what=f"the {craft.__name__} rogue to be banned")
                reply = await rogue.lease()
                assert not isinstance(reply, Lease) and reply.done and "banned" in reply.reason
                # `peers` shows it banned, and why, from the learner's signed card.
                assert await rogue.announce()

                def shown_banned() -> str | None:
                    rows = {p["peer_id"]: p for p in peers_json(local_swarm.bootstrap_addr, local_swarm.swarm)}
                    return (rows.get(rogue.peer_id) or {}).get("banned")

                shown = await asyncio.to_thread(wait_until, shown_banned, 60, interval=1.0,
                                                what="`peers` to show the rogue banned")
                assert "verify" in shown
        return out

    rogues = asyncio.run(attacks())
    banned = _banned(info)
    for peer, accepted in rogues:
        assert accepted >= 1, "the intake accepted the crafted group (shapes are fine); verification must catch it"
        assert "verify" in banned[peer], banned[peer]
    steps_at_ban = len(read_metrics(metrics))
    wait_until(lambda: len(read_metrics(metrics)) >= steps_at_ban + 5, 300, what="training to go on after the bans")

    records = read_metrics(metrics)
    for r in records:
        for key in ("loss", "grad_norm", "reward_mean"):
            assert r[key] is not None and math.isfinite(r[key]), (r["step"], key, r[key])
    refused = sum(sum(r.get("verify_refused", {}).values()) for r in records)
    assert refused >= 2, "both rogues' groups were refused by verification"
    assert sum(r.get("skipped_nonfinite", 0) for r in records) == 0, "nothing non-finite reached the loss"
    stats = http_json(info)["stats"]
    assert stats["accepted"] > 0 and honest.info["peer_id"] not in stats["peers"]["banned"]

    # What the honest peer installed, i.e. what the learner signed after the attacks, is finite.
    local_swarm.close()  # stops the daemons: the store no longer changes under us
    held = VersionStore(honest.state_dir).versions()
    assert held and held[-1] > steps_at_ban, held
    tensors = load_file(str(VersionStore(honest.state_dir).dir(held[-1]) / "model.safetensors"))
    assert all(np.isfinite(t).all() for t in tensors.values())
