"""The RL loop on a real swarm: learner + rollout peers as processes, trajectories over libp2p."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers.swarm import LocalSwarm, http_json, learner_toml, read_metrics, wait_until

from echo2swarm.daemon.metric_names import unmapped

# 900 s: the first test of a session to ask for warm_model_dir builds it (minutes on a busy 2-core box).
pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]
PACED = {"ECHO2SWARM_WORKER__MAX_ROLLOUTS_PER_S": "40", "ECHO2SWARM_ENGINE__THREADS": "1"}


def _metrics(learner) -> Path:
    return learner.state_dir / "run" / "metrics.jsonl"


@pytest.mark.slow
def test_training_respects_staleness_and_survives_a_killed_rollout_peer(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
):
    from echo2swarm.wire.signing import PolicyKey

    staleness = 1
    local_swarm.bootstrap()
    trust = Path(f"{policy_key}.pub")
    # A verifier daemon computes the exact checks of older versions (offload = always): the learner's
    # signed head lists it, and every group one version old is checked there (sample_fraction 1).
    verifier = local_swarm.start("verifier", "--role", "verifier", "--trust", str(trust), "--device", "cpu",
                                 env={"ECHO2SWARM_CHECK__THREADS": "1"})
    verifier_id = local_swarm.ready(verifier)["peer_id"]
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=30, staleness=staleness,
                          sections={"verify": {"verifiers": [verifier_id], "offload": "always", "sample_fraction": 1.0}})
    # Every peer must get work here (the slow one is the one killed): no cost-aware standby.
    learner = local_swarm.start("learner", "--config", str(config), env={"ECHO2SWARM_ACTIVATION__ENABLED": "false"})
    # A second learner with another key in the same swarm: pinned rollout peers must not work for it.
    rogue_key = tmp_path / "rogue.key"
    PolicyKey.generate().save(rogue_key)
    rogue = local_swarm.start("rogue", "--config", str(learner_toml(tmp_path / "rogue.toml", tiny_model_dir, rogue_key)))
    # Both peers paced: the steps left after the kill then take the survivor alone longer than the
    # 5 s lease timeout however fast the machine, so the killed peer's lease must expire and be
    # re-issued before training can end (unpaced, a fast box finished first and nothing expired).
    survivor = local_swarm.rollout("rollout-1", trust=trust, env=PACED)
    victim = local_swarm.rollout("rollout-2", trust=trust, env=PACED)
    for d in (learner, rogue, survivor, victim):
        local_swarm.ready(d)
    # Killed once it has delivered and holds a lease it has not generated yet: its engine process
    # may take seconds to start on a busy machine, and the learner leases no more than the
    # staleness window can train.
    victim_info = victim.info["chunk_url"] + "/v1/info"

    def delivered_and_holds_a_lease() -> bool:
        worker = http_json(victim_info)["stats"].get("worker", {})
        return worker.get("groups_accepted", 0) > 0 and worker.get("leases", 0) > worker.get("batches", 0)

    wait_until(delivered_and_holds_a_lease, 90, interval=0.02, what="the slow peer to deliver and hold a lease")
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = len(read_metrics(_metrics(learner)))
    assert learner.proc is not None
    learner.proc.wait(180)  # the learner exits by itself after its last step
    assert learner.proc.returncode == 0, learner.log_tail()

    records = read_metrics(_metrics(learner))
    assert [r["step"] for r in records] == list(range(1, 31)), "every step ran once, in order"
    for r in records:
        assert all(0 <= s <= staleness for s in r["staleness"]), f"step {r['step']} trained on staleness {r['staleness']}"
        assert r["version"] == r["step"]  # version v is the policy before step v
    end = records[-1]
    trained = 8 * len(records)
    # No accepted group is lost: each one was trained on, dropped by the staleness rule (counted), or left over.
    assert end["accepted"] >= trained + end["dropped"].get("stale", 0)
    assert end["accepted"] - trained - sum(end["dropped"].values()) <= (staleness + 1) * 8
    assert end["leases"].get("reissued", 0) >= 1, "the killed peer's lease should have been re-issued"
    # >= 10 steps left: >= 320 rollouts at <= 40/s, 8 s for the survivor alone, past the lease timeout.
    assert killed_at <= 20 and survivor.running()
    delivered = end["delivered"]
    assert delivered.get(survivor.info["peer_id"], 0) > 0 and delivered.get(victim.info["peer_id"], 0) > 0
    # Every group was drawn with the lease's seeded sampler (none refused `unseeded`), and the learner
    # re-derived the choices of those of each step's own version without refusing one (protocol.md §10.4.1).
    assert "unseeded" not in end["refused"]
    assert sum(r["verify_choices"] for r in records) > 0 and not any(r["verify_refused"] for r in records)
    # The groups one version old were checked exactly on the verifier daemon, over libp2p, and it
    # computed for this learner only (the rogue's head does not list it).
    remote = sum(r["verify_remote"] for r in records)
    verifier_info = http_json(verifier.info["chunk_url"] + "/v1/info")
    assert unmapped(verifier_info) == []  # every figure a verifier counts is on its /metrics
    checks = verifier_info["stats"]["checks"]
    assert remote > 0 and checks["served"] > 0 and checks["rows"] >= 4 * remote, (remote, checks)
    assert checks.get("refused_not_listed", 0) == 0 and checks.get("refused_failed", 0) == 0
    assert (learner.state_dir / "run" / "final" / "config.json").exists()
    rogue_stats = http_json(rogue.info["chunk_url"] + "/v1/info")["stats"]
    assert rogue_stats["accepted"] == 0 and rogue_stats["steps_done"] == 0


@pytest.mark.slow
def test_killed_learner_resumes_from_checkpoint_and_peers_reattach(
    local_swarm: LocalSwarm, warm_model_dir: Path, policy_key: Path, tmp_path: Path
):
    # 60 steps: the reward's rise from the first 20 steps to the last 20 shows by then (measured: +0.07 at
    # step 60, +0.08 at 90, steps' rewards scattered by 0.05); resuming needs one checkpoint, step 20's.
    config = learner_toml(tmp_path / "learner.toml", warm_model_dir, policy_key, steps=60, checkpoint_every=20,
                          prompts_per_step=16, group_size=8)
    local_swarm.bootstrap()
    learner = local_swarm.start("learner", "--config", str(config))
    trust = Path(f"{policy_key}.pub")
    peers = [local_swarm.rollout(f"rollout-{i}", trust=trust) for i in (1, 2)]
    for d in (learner, *peers):
        local_swarm.ready(d)
    pids = [p.pid for p in peers]
    checkpoints = learner.state_dir / "run" / "checkpoints"
    wait_until(lambda: (checkpoints / "step-00000020").is_dir(), 240, interval=0.2, what="the step-20 checkpoint")
    before = read_metrics(_metrics(learner))
    last_published = max(r["published_version"] for r in before)
    os.kill(learner.pid, signal.SIGKILL)

    restarted = local_swarm.start("learner-again", "--config", str(config), state_dir=learner.state_dir)
    local_swarm.ready(restarted)
    assert restarted.proc is not None
    restarted.proc.wait(240)
    assert restarted.proc.returncode == 0, restarted.log_tail()

    records = read_metrics(_metrics(learner))
    after = records[len(before):]
    assert after and after[0]["step"] == 21, "training resumes after the last checkpoint"
    assert after[-1]["step"] == 60
    assert min(r["version"] for r in after) > last_published, "versions continue strictly upward"
    # The same rollout peer processes reattached and now hold a post-restart version.
    assert [p.pid for p in peers] == pids and all(p.running() for p in peers)
    for p in peers:
        assert http_json(p.info["chunk_url"] + "/v1/info")["version"] > last_published
    first = [r["reward_mean"] for r in before[:20]]
    last = [r["reward_mean"] for r in after[-20:]]
    assert sum(last) / len(last) > sum(first) / len(first), f"reward did not rise: {first} -> {last}"
