"""GET /metrics on every daemon of a real swarm, parsed with prometheus-client's own parser."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers.swarm import LocalSwarm, http_json, learner_toml, wait_until
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from echo2swarm import __version__
from echo2swarm.daemon.metric_names import PREFIX, families, sample_names, unmapped

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]
PARSED_TYPE = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "info": "gauge"}


def _scrape(daemon: Any) -> dict[str, Any]:
    with urllib.request.urlopen(daemon.info["http_url"] + "/metrics", timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == CONTENT_TYPE_LATEST
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(scraped: dict[str, Any], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for f in scraped.values() for s in f.samples if s.name == name}


def _value(scraped: dict[str, Any], name: str, **labels: str) -> float:
    return _samples(scraped, name)[tuple(sorted(labels.items()))]


def _check(scraped: dict[str, Any], role: str) -> None:
    """The daemon's identity, and every echo2swarm family declared with its type, bounded labels only."""
    info = scraped["echo2swarm_daemon_info"].samples[0].labels
    assert info["role"] == role and info["software"] == __version__
    declared = {(n.removesuffix("_total") if f.kind == "counter" else n): (n, f) for n, f in families().items()}
    for name, family in scraped.items():
        if name.startswith(PREFIX):
            full, spec = declared[name]
            assert family.type == PARSED_TYPE[spec.kind], name
            for sample in family.samples:
                assert sample.name in sample_names(full, spec)
                assert set(sample.labels) - {"le"} <= {spec.label, "role", "software", "swarm"}
                assert not any(v.startswith("12D3") for v in sample.labels.values()), "a peer id as a label"
    assert _value(scraped, "process_resident_memory_bytes") > 0


def _no_chunks_over_http(daemon: Any) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(daemon.info["http_url"] + "/v1/chunk/" + "0" * 64, timeout=10)
    assert e.value.code == 404


def test_every_daemon_serves_prometheus_metrics(local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path,
                                                tmp_path: Path):
    staleness = 1
    bootstrap = local_swarm.bootstrap()
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=100_000, staleness=staleness)
    learner = local_swarm.start("learner", "--config", str(config))
    trust = Path(f"{policy_key}.pub")
    rollout = local_swarm.rollout("rollout-1", trust=trust)
    # Without a chunk server a daemon still serves /metrics (and /v1/info), and nothing to the swarm.
    relay = local_swarm.start("relay", "--role", "relay", "--trust", str(trust), "--no-chunk-server")
    for d in (learner, rollout, relay):
        local_swarm.ready(d)
    assert relay.info["chunk_url"] is None and bootstrap.info["chunk_url"] is None
    assert relay.info["http_url"] and bootstrap.info["http_url"]
    # A step counts as done once trained; its time is observed after its version is published.
    wait_until(lambda: _value(_scrape(learner), "echo2swarm_learner_step_seconds_count") >= 3, 120, interval=0.2,
               what="3 learner steps timed")
    wait_until(lambda: (http_json(relay.info["http_url"] + "/v1/info")["version"] or 0) >= 1, 60, interval=0.2,
               what="the relay to hold a version")

    scraped = {d.name: _scrape(d) for d in (bootstrap, learner, rollout, relay)}
    for d in (bootstrap, learner, rollout, relay):
        _check(scraped[d.name], d.info["role"])
        assert unmapped(http_json(d.info["http_url"] + "/v1/info")) == [], f"{d.name}: stats without a metric"

    m = scraped["learner"]
    steps = _value(m, "echo2swarm_learner_steps_total")
    assert steps >= 3
    assert _value(m, "echo2swarm_server_sent_bytes_total") > 0  # the peers fetched v1 from it
    assert _value(m, "echo2swarm_policy_version") >= 2
    assert _value(m, "echo2swarm_learner_groups_accepted_total") >= 8 * 3
    assert _value(m, "echo2swarm_learner_leases_issued_total") > 0
    assert _value(m, "echo2swarm_learner_staleness_limit") == staleness
    assert 0.0 <= _value(m, "echo2swarm_learner_reward") <= 1.0
    assert 0.0 <= _value(m, "echo2swarm_learner_bubble_ratio") <= 1.0
    assert _value(m, "echo2swarm_learner_cost_usd_total") >= 0.0
    # Step time: one observation per step recorded, cumulative buckets ending at +Inf = count.
    count = _value(m, "echo2swarm_learner_step_seconds_count")
    assert 3 <= count <= steps and _value(m, "echo2swarm_learner_step_seconds_bucket", le="+Inf") == count
    buckets = [v for _, v in sorted(((float(dict(k)["le"]), v) for k, v in
                                     _samples(m, "echo2swarm_learner_step_seconds_bucket").items()))]
    assert buckets == sorted(buckets)
    assert 0 <= _value(m, "echo2swarm_learner_wait_seconds_total") <= _value(m, "echo2swarm_learner_step_seconds_sum")
    # Staleness: one bucket per step up to S, and every group trained within it.
    staleness_buckets = {dict(k)["le"]: v for k, v in _samples(m, "echo2swarm_learner_group_staleness_bucket").items()}
    assert set(staleness_buckets) == {"0.0", "1.0", "+Inf"}
    assert staleness_buckets["1.0"] == staleness_buckets["+Inf"] == _value(m, "echo2swarm_learner_group_staleness_count")
    assert staleness_buckets["+Inf"] >= 8 * 3

    r = scraped["rollout-1"]
    assert _value(r, "echo2swarm_policy_versions_held") >= 1 and _value(r, "echo2swarm_policy_version") >= 1
    assert _value(r, "echo2swarm_fetch_received_bytes_total") > 0
    assert _value(r, "echo2swarm_rollout_tokens_total") > 0
    assert _value(r, "echo2swarm_rollout_groups_accepted_total") > 0
    assert _value(r, "echo2swarm_rollout_engine_seconds_total", state="generating") > 0
    assert {dict(k)["state"] for k in _samples(r, "echo2swarm_rollout_engine_seconds_total")} <= \
        {"generating", "waiting", "starved"}
    assert _value(r, "echo2swarm_rollout_rollouts_per_second") > 0

    assert _value(scraped["relay"], "echo2swarm_policy_versions_held") >= 1
    assert _value(scraped["relay"], "echo2swarm_fetch_received_bytes_total") > 0
    assert not any(name.startswith("echo2swarm_learner_") for name in scraped["bootstrap"])
    # The DHT's traffic, sent and served: every daemon stores its card (a find of the nearest nodes, then
    # a store); the bootstrap, the DHT node they all joined through, served finds and stores.
    for d in (bootstrap, learner, rollout, relay):
        assert _value(scraped[d.name], "echo2swarm_dht_requests_total", rpc="sent_store") > 0, d.name
        assert _value(scraped[d.name], "echo2swarm_dht_bytes_total", rpc="sent_find") > 0, d.name
    for rpc in ("served_find", "served_store"):
        assert _value(scraped["bootstrap"], "echo2swarm_dht_requests_total", rpc=rpc) > 0, rpc
    for d in (bootstrap, relay):
        _no_chunks_over_http(d)

    # Counters only go up between scrapes; the step histogram follows the steps recorded since.
    later = _scrape(learner)
    assert _value(later, "echo2swarm_learner_steps_total") >= steps
    assert _value(later, "echo2swarm_learner_step_seconds_count") >= count
    assert _value(later, "echo2swarm_server_sent_bytes_total") >= _value(m, "echo2swarm_server_sent_bytes_total")
