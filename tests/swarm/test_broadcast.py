"""Peer-assisted broadcast with real daemons on 127.0.0.1: chains, churn, liars, libp2p-only peers.

The learner's uplink is capped (`--upload-limit`) so a version takes seconds to leave it, which
gives the tests a window in which peers are mid-fetch; relays poll the head fast so they all
start together, as rollout peers do when a lease reply offers them the head.
"""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path
from typing import Any

import pytest
from helpers.swarm import LocalSwarm, SwarmWatcher, http_json, learner_toml, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
FAST_HEAD = {"ECHO2SWARM_FETCH__HEAD_POLL_S": "0.2"}
CHUNK = "64KiB"
HOSTS = {f"ECHO2SWARM_CHUNK_SERVER__{k}": v for k, v in (
    ("MAX_WAITING", "256"), ("MAX_WAITING_PER_CLIENT", "128"), ("UPLOAD_SLOTS", "128"), ("UPLOAD_SLOTS_PER_CLIENT", "64"),
    ("MAX_CONNECTIONS", "512"), ("MAX_CONNECTIONS_PER_CLIENT", "256"))}


def _info(daemon: Any) -> dict[str, Any]:
    return http_json(daemon.info["chunk_url"] + "/v1/info")


def _relays(swarm: LocalSwarm, key: Path, names: list[str], *args: str, env: dict[str, str] | None = None) -> list[Any]:
    relays = [swarm.start(n, "--role", "relay", "--trust", f"{key}.pub", *args, env={**FAST_HEAD, **(env or {})})
              for n in names]
    for relay in relays:
        swarm.ready(relay)
    return relays


def _wait_for_cards(swarm: LocalSwarm, peer_ids: set[str]) -> None:
    """The learner plans over the cards it sees when it publishes: let the relays' cards land first."""
    assert swarm.bootstrap_addr
    with SwarmWatcher(swarm.bootstrap_addr, swarm.swarm) as watcher:
        wait_until(lambda: peer_ids <= set(watcher.peers()), 30, interval=0.3, what="relay cards in the DHT")


def _model_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.iterdir() if p.is_file())


def _genuine_chunks(state_dir: Path) -> int:
    files = [p for p in (state_dir / "chunks").rglob("*") if p.is_file() and not p.name.startswith(".")]
    for p in files:
        assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name, f"{p} does not hash to its name"
    return len(files)


def test_relays_under_a_tree_and_foster_parents_cost_the_learner_one_copy(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path
):
    # A tree plan (what swarms of 64 planned peers and more get; chains, the smaller swarms' plan, are the
    # other tests' here) over 6 of 10 relays (publish.plan_unproven = 6: none of them was seen working), as
    # the 40-relay benchmark's plan leaves 8 of its relays out: those take the version from their foster
    # parents (BroadcastPlan.fosters), not from the learner. 10 relays, not the 16 issue 35 suggests: 16
    # cost make test ~50 s (18 daemons starting beside the other CI worker's test); the 40 are a benchmark
    # (scripts/bench_control_traffic.py).
    local_swarm.bootstrap()
    # Every relay is one client here (127.0.0.1): budgets per client as 10 hosts' would add up. Cards every 3 s
    # and heads every 1 s (the long-poll of the learner's head after the first): 16 relays announcing every
    # second and polling the DHT five times a second starved a test on the other CI worker of both cores.
    quiet = ["--announce-period", "3", "--record-ttl", "9", "--log-level", "INFO"]
    relays = _relays(local_swarm, policy_key, [f"r{i}" for i in range(10)], *quiet,
                     env={**HOSTS, "ECHO2SWARM_FETCH__HEAD_POLL_S": "1"})
    by_id = {r.info["peer_id"]: r for r in relays}
    _wait_for_cards(local_swarm, set(by_id))
    learner = local_swarm.learner(tiny_model_dir, policy_key, "--upload-limit", "1MiB", "--chunk-size", CHUNK, *quiet,
                                  env={"ECHO2SWARM_PUBLISH__PLAN_SHAPE": "trees", "ECHO2SWARM_PUBLISH__PLAN_UNPROVEN": "6",
                                       **HOSTS})
    local_swarm.ready(learner)
    for relay in relays:
        wait_until(lambda: _info(relay)["versions"] == [1], 90, interval=0.5, what=f"{relay.name} at v1")

    plan = http_json(learner.info["chunk_url"] + "/v1/plan/1")
    placed = set(plan["tree"]["order"])
    assert plan["stripes"] == [] and len(placed) == 6 and placed <= set(by_id)
    served = _info(learner)["stats"]["server"]["bytes_served"]
    model = _model_bytes(tiny_model_dir)
    # Ten full copies left the swarm's peers; the learner uploaded about one of them: a relay whose plan
    # parent (or foster parent) had not begun v1 yet asked it again (ParentPatience) instead of the learner,
    # and none routed a chunk before it knew its parent's card.
    assert served <= 1.1 * model, (served, model)
    from_peers = 0
    for peer_id, relay in by_id.items():
        stats = _info(relay)["stats"]
        assert stats["fetch"].get("parent_unknown", 0) == 0, (relay.name, stats["fetch"])
        # It read its upstream peers' (or foster parents') cards by their own keys, and the card shards only for
        # a parent's card that its own key did not give (parent_card_fallback).
        reads, fallbacks = stats["card_reads"], stats["fetch"].get("parent_card_fallback", 0)
        assert reads.get("named", 0) >= 1 and reads.get("shared", 0) <= fallbacks, (relay.name, reads, fallbacks)
        sources = stats["fetched_from"]
        from_peers += sum(n for name, n in sources.items() if not name.startswith("learner:"))
        if peer_id not in placed:  # left out of the plan: all of it from planned peers
            assert not any(name.startswith("learner:") for name in sources), (relay.name, sources)
        assert _genuine_chunks(relay.state_dir) > 1
    assert from_peers >= 8 * model, "most bytes must have come from peers, not from the learner"


def test_killing_a_relay_mid_broadcast_leaves_every_other_peer_with_the_version(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path
):
    local_swarm.bootstrap()
    relays = _relays(local_swarm, policy_key, ["r1", "r2", "r3", "r4"])
    by_id = {r.info["peer_id"]: r for r in relays}
    _wait_for_cards(local_swarm, set(by_id))
    # 256 KiB/s: the ~1.2 MB version takes ~5 s to leave the learner, plenty of time to kill mid-way.
    learner = local_swarm.learner(tiny_model_dir, policy_key, "--upload-limit", "256KiB", "--chunk-size", CHUNK)
    local_swarm.ready(learner)
    plan = wait_until(lambda: http_json(learner.info["chunk_url"] + "/v1/plan/1"), 30, what="the plan")
    chain = plan["stripes"][0]
    victim = by_id[chain[1]]  # mid-chain: the peer after it depends on it
    wait_until(lambda: _info(victim)["stats"].get("fetching_version") == 1, 30, interval=0.05, what="victim fetching")
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    survivors = [r for r in relays if r is not victim]
    for relay in survivors:
        wait_until(lambda: _info(relay)["versions"] == [1], 90, interval=0.2, what=f"{relay.name} at v1 after the kill")
        assert _genuine_chunks(relay.state_dir) > 1
    assert 1 not in _info(survivors[0])["stats"].get("refused_heads", {})


def test_a_peer_serving_flipped_bytes_is_banned_and_its_chunks_fetched_elsewhere(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path
):
    local_swarm.bootstrap()
    # The learner's uplink capped: the late relay's fetch outlasts its first card reads (every
    # fetch.holders_refresh_s), so its later chunks are routed to the relays too, evil included,
    # whatever its first read found when the head came.
    learner = local_swarm.learner(tiny_model_dir, policy_key, "--chunk-size", CHUNK, "--upload-limit", "128KiB")
    local_swarm.ready(learner)
    honest, evil = _relays(local_swarm, policy_key, ["honest", "evil"])
    for relay in (honest, evil):
        wait_until(lambda: _info(relay)["versions"] == [1], 60, interval=0.2, what=f"{relay.name} at v1")
    # The evil relay's disk now holds flipped bytes under every chunk name: it serves them as-is.
    for path in (evil.state_dir / "chunks").rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
    _wait_for_cards(local_swarm, {evil.info["peer_id"], honest.info["peer_id"]})

    late = _relays(local_swarm, policy_key, ["late"])[0]
    wait_until(lambda: _info(late)["versions"] == [1], 60, interval=0.2, what="the late relay at v1")
    stats = _info(late)["stats"]
    assert stats["fetch"].get("bad_chunk", 0) >= 1, stats["fetch"]
    evil_name = "relay:" + evil.info["peer_id"][-8:]
    assert stats["fetched_from"].get(evil_name, 0) == 0, "no byte from the liar may have been kept"
    assert _genuine_chunks(late.state_dir) > 1
    assert "does not match its hash: refused, source banned" in (late.state_dir / "daemon.log").read_text()


def test_a_learner_without_http_still_disseminates_over_libp2p(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path
):
    local_swarm.bootstrap()
    natted = _relays(local_swarm, policy_key, ["natted"], "--no-chunk-server")[0]
    _wait_for_cards(local_swarm, {natted.info["peer_id"]})
    learner = local_swarm.learner(tiny_model_dir, policy_key, "--no-chunk-server", "--chunk-size", CHUNK)
    local_swarm.ready(learner)
    assert learner.info["chunk_url"] is None and natted.info["chunk_url"] is None
    # Only libp2p reaches either of them. The HTTP relay joins later and fetches from both.
    plain = _relays(local_swarm, policy_key, ["plain"])[0]
    wait_until(lambda: _info(plain)["versions"] == [1], 60, interval=0.2, what="the HTTP relay at v1")
    assert _genuine_chunks(plain.state_dir) > 1
    assert _genuine_chunks(natted.state_dir) > 1  # the libp2p-only relay got the version too
    with SwarmWatcher(local_swarm.bootstrap_addr or "", local_swarm.swarm) as watcher:
        card = wait_until(lambda: watcher.peers().get(natted.info["peer_id"], {}).get("version") == 1
                          and watcher.peers()[natted.info["peer_id"]], 30, interval=0.3, what="natted card at v1")
    assert card["chunk_url"] is None


@pytest.mark.timeout(900)  # may build the session's warm model (minutes on a busy 2-core box)
def test_a_rollout_peer_keeps_generating_while_it_fetches_the_next_version(
    local_swarm: LocalSwarm, warm_model_dir: Path, policy_key: Path, tmp_path: Path
):
    local_swarm.bootstrap()
    # The warm model learns, so every version has new chunks (an untrained one can repeat its weights,
    # and content addressing then makes the next version free to fetch).
    config = learner_toml(tmp_path / "learner.toml", warm_model_dir, policy_key, steps=100, staleness=2,
                          prompts_per_step=4, group_size=2)
    # 512 KiB/s: each ~1.2 MB version takes over 2 s to arrive, several rollouts long.
    learner = local_swarm.start("learner", "--config", str(config), "--upload-limit", "512KiB", "--chunk-size", CHUNK)
    local_swarm.ready(learner)
    rollout = local_swarm.rollout("gen", trust=Path(f"{policy_key}.pub"), env=FAST_HEAD)
    local_swarm.ready(rollout)

    during: list[tuple[int, int]] = []  # (version being fetched, rollouts so far) while a fetch runs

    def generated_during_a_fetch() -> bool:
        stats = _info(rollout)["stats"]
        fetching = stats.get("fetching_version")
        if fetching is not None:
            during.append((fetching, stats["worker"].get("rollouts", 0)))
        same = [n for v, n in during if during and v == during[-1][0]]
        return len(same) >= 2 and same[-1] > same[0]

    wait_until(generated_during_a_fetch, 120, interval=0.1, what="rollouts completed during one version's fetch")
