"""Delta versions with real daemons: a training learner publishes bf16 keyframes and deltas, and
relays that follow every version, skip versions (stopped), restart mid-chain or join late all end
with weights bit-identical to the learner's dense version (tensor sha256 compared)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from helpers.swarm import LocalSwarm, http_json, learner_toml, peers_json, wait_until

# 900 s: generous for a busy 2-core box; the scenario itself takes about a minute.
pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]
FAST_HEAD = {"ECHO2SWARM_FETCH__HEAD_POLL_S": "0.2"}
PACED = {"ECHO2SWARM_WORKER__MAX_ROLLOUTS_PER_S": "40", "ECHO2SWARM_ENGINE__THREADS": "1"}


def _info(daemon: Any) -> dict[str, Any]:
    return http_json(daemon.info["chunk_url"] + "/v1/info")


def _tensor_hashes(path: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    from echo2swarm.policy.delta import tensor_sha256

    return {name: tensor_sha256(t) for name, t in load_file(str(path)).items()}


def _delta_learner_toml(path: Path, model: Path, key: Path) -> Path:
    # The untrained tiny model earns no reward, so gradients are zero; AdamW's decoupled weight decay
    # (lr x decay = 2e-4 a step) still moves every fp32 master, and a few percent of the bf16 casts.
    # Values are held for 0.75 ulp (publish.hold_ulps): followers rebuild whatever bytes were published.
    return learner_toml(path, model, key, steps=400, staleness=1, lr=1e-4, weight_decay=2.0, min_step_s=0.4,
                        checkpoint_every=1000,
                        publish={"dtype": "bfloat16", "keyframe_every": 5, "chunk_size": "64KiB", "hold_ulps": 0.75})


@pytest.mark.slow
def test_followers_that_skip_restart_or_join_late_rebuild_the_learners_exact_weights(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
):
    config = _delta_learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key)
    local_swarm.bootstrap()
    learner = local_swarm.start("learner", "--config", str(config), env={"ECHO2SWARM_ACTIVATION__ENABLED": "false"})
    trust = Path(f"{policy_key}.pub")
    worker = local_swarm.rollout("rollout", trust=trust, env=PACED)
    relays = {n: local_swarm.start(n, "--role", "relay", "--trust", str(trust), env=FAST_HEAD)
              for n in ("steady", "skipper", "restarted")}
    for d in (learner, worker, *relays.values()):
        local_swarm.ready(d, timeout=120)

    def published() -> int:
        return _info(learner)["stats"].get("published_version") or 0

    def held(relay: Any) -> int:
        return max(_info(relay)["versions"] or [0])

    wait_until(lambda: all(held(r) >= 2 for r in relays.values()), 180, interval=0.2, what="relays at v2")
    skipper, restarted = relays["skipper"], relays["restarted"]
    # The skipper misses several versions (its process stopped), then catches up from what it holds.
    skipper.proc.send_signal(signal.SIGSTOP)
    stopped_at = held_before = None
    try:
        stopped_at = published()
        wait_until(lambda: held(restarted) >= stopped_at + 1, 120, interval=0.2, what="restarted relay mid-chain")
        restarted.terminate(grace=10)
        held_before = max(int(p.name[1:]) for p in (restarted.state_dir / "versions").glob("v*") if p.is_dir())
        wait_until(lambda: published() >= stopped_at + 7, 240, interval=0.3, what="several versions published")
    finally:
        skipper.proc.send_signal(signal.SIGCONT)
    # Its first install after the gap came by several hops, a composite or the keyframe: never one delta.
    # (It may first install stopped_at + 1 by one delta: a head long-poll answered as it stopped. Any later
    # version was published while it was stopped; which one it installs first depends on when it reads the head.)
    resumed = wait_until(lambda: [p for v, p in sorted(_info(skipper)["stats"]["fetch_path_of"].items(), key=lambda i: int(i[0]))
                                  if int(v) > stopped_at + 1], 120, interval=0.2, what="the skipper to catch up")
    catch_up = resumed[0]
    assert catch_up["path"] in ("chain", "composite", "keyframe") and (catch_up["hops"] >= 2 or catch_up["path"] != "chain")
    restarted = local_swarm.start("restarted", "--role", "relay", "--trust", str(trust), env=FAST_HEAD,
                                  state_dir=restarted.state_dir)
    local_swarm.ready(restarted, timeout=120)
    late = local_swarm.start("late", "--role", "relay", "--trust", str(trust), env=FAST_HEAD)
    local_swarm.ready(late, timeout=120)
    followers = {"steady": relays["steady"], "skipper": skipper, "restarted": restarted, "late": late}

    target = published()
    for name, relay in followers.items():
        wait_until(lambda: held(relay) >= target, 240, interval=0.3, what=f"{name} at v{target} or later")

    stats = _info(learner)["stats"]
    assert stats["server"].get("head_waited", 0) >= 1, stats["server"]  # followers long-poll the head
    kinds = {int(v): r for v, r in stats["versions"].items()}
    assert any(r["kind"] == "delta" for r in kinds.values()), kinds
    assert any(r["kind"] == "dense" and r["keyframe_reason"] == "interval" for r in kinds.values()), kinds
    for r in kinds.values():
        if r["kind"] == "delta":
            assert r["delta_bytes"] < 0.5 * r["dense_bytes"] and r["ratio"] > 2, r
    assert max(r["delta_bytes"] or 0 for r in kinds.values()) > 1000, "the weights must change between versions"

    learner_versions = learner.state_dir / "versions"
    for name, relay in followers.items():
        info = _info(relay)
        compared = 0
        for v in info["versions"]:
            ours, theirs = relay.state_dir / "versions" / f"v{v:08d}", learner_versions / f"v{v:08d}"
            try:
                mine, learners = _tensor_hashes(ours / "model.safetensors"), _tensor_hashes(theirs / "model.safetensors")
                signed = json.loads((relay.state_dir / "versions" / f"v{v:08d}.manifest").read_text())["manifest"]
            except FileNotFoundError:
                continue  # garbage-collected meanwhile, by the learner or by the follower (both keep publishing)
            assert mine == learners, (name, v)
            assert {t["name"]: t["sha256"] for t in signed["tensors"]} == mine
            compared += 1
        assert compared >= 1, (name, info["versions"])
        paths = info["stats"]["fetch_paths"]
        # where each install's time went (policy/follower.py): every path fetched chunks and checked them
        assert all({"manifest", "chunks", "check", "commit"} <= set(p["spans"])
                   for p in info["stats"]["fetch_path_of"].values()), info["stats"]["fetch_path_of"]
        assert not {k: n for k, n in info["stats"]["refused_heads"].items() if k.startswith("delta_")}, name
        if name == "late":
            assert paths.get("keyframe", 0) >= 1, paths
        else:
            assert sum(n for p, n in paths.items() if p != "keyframe") >= 1, (name, paths)
    # `echo2swarm peers`: each follower's path and bytes, and the learner's newest versions (from the cards)
    assert local_swarm.bootstrap_addr
    by_id = {p["peer_id"]: p for p in peers_json(local_swarm.bootstrap_addr, local_swarm.swarm)}
    for name, relay in followers.items():
        row = by_id[relay.info["peer_id"]]
        assert row["fetch_path"] in ("delta", "chain", "composite", "keyframe") and row["fetch_bytes"] > 0, (name, row)
    notes = by_id[learner.info["peer_id"]]["versions"]
    assert notes and all(n["kind"] in ("dense", "delta") and n["dense_bytes"] > 0 for n in notes), notes
    assert held_before is not None


def test_float32_publishing_keeps_exact_bases(local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path,
                                                tmp_path: Path):
    """In float32 on the CPU the publish cast is the live parameters: the learner must keep a copy as the
    next delta's base, or its deltas come out empty and every follower refuses them."""
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=400, staleness=1, lr=1e-3,
                          weight_decay=0.5, min_step_s=0.4, checkpoint_every=1000,
                          publish={"dtype": "float32", "delta_max_ratio": 1.0, "chunk_size": "64KiB"})
    local_swarm.bootstrap()
    learner = local_swarm.start("learner", "--config", str(config), env={"ECHO2SWARM_ACTIVATION__ENABLED": "false"})
    trust = Path(f"{policy_key}.pub")
    worker = local_swarm.rollout("rollout", trust=trust, env=PACED)
    relay = local_swarm.start("relay", "--role", "relay", "--trust", str(trust), env=FAST_HEAD)
    for d in (learner, worker, relay):
        local_swarm.ready(d, timeout=120)
    wait_until(lambda: max(_info(relay)["versions"] or [0]) >= 4, 240, interval=0.3, what="the relay at v4")
    stats = _info(relay)["stats"]
    assert not {k: n for k, n in stats["refused_heads"].items() if k.startswith("delta_")}, stats["refused_heads"]
    assert sum(n for p, n in stats["fetch_paths"].items() if p != "keyframe") >= 1, stats["fetch_paths"]
    for v in _info(relay)["versions"]:
        theirs = learner.state_dir / "versions" / f"v{v:08d}" / "model.safetensors"
        if theirs.exists():
            ours = relay.state_dir / "versions" / f"v{v:08d}" / "model.safetensors"
            assert _tensor_hashes(ours) == _tensor_hashes(theirs), v
