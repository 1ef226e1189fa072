"""Delta versions in /metrics: the learner's per-version byte figures and the followers' fetch paths,
with bounded labels (a kind, a path, a reason; never a peer id or a version)."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from echo2swarm.daemon.metric_names import families, unmapped
from echo2swarm.daemon.prometheus import daemon_registry

PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBmGhKbbstVWx9S"


def _scrape(info: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(daemon_registry(lambda: info, lambda: [1, 2])).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_learner_exports_the_newest_versions_bytes_and_kinds():
    versions = {"11": {"kind": "dense", "dense_bytes": 600, "delta_bytes": 20, "composite_bytes": None, "ratio": 30.0,
                       "keyframe_reason": "interval"},
                "12": {"kind": "delta", "dense_bytes": 600, "delta_bytes": 25, "composite_bytes": 40, "ratio": 24.0,
                       "keyframe_reason": None}}
    info = {"role": "learner", "stats": {
        "published_version": 12, "versions": versions,
        "publish": {"dense_bytes": 600, "delta_bytes": 25, "composite_bytes": 40, "delta_ratio": 24.0,
                    "kinds": {"dense": 2, "delta": 10}}}}
    assert unmapped(info) == []
    scraped = _scrape(info)
    assert scraped[("echo2swarm_learner_version_dense_bytes", ())] == 600
    assert scraped[("echo2swarm_learner_version_delta_bytes", ())] == 25
    assert scraped[("echo2swarm_learner_version_composite_bytes", ())] == 40
    assert scraped[("echo2swarm_learner_version_delta_ratio", ())] == 24.0
    assert scraped[("echo2swarm_learner_versions_published_total", (("kind", "delta"),))] == 10
    assert not any("12" == v for _, labels in scraped for _, v in labels)  # no version as a label


def test_a_follower_exports_its_fetch_paths_and_refused_deltas():
    info = {"role": "relay", "stats": {
        "fetch_paths": {"delta": 7, "chain": 1, "composite": 2, "keyframe": 1},
        "fetch_path_of": {"12": {"path": "delta", "bytes": 25, "hops": 1}}, "fetch_bytes_last": 25,
        "refused_heads": {"delta_tensor_hash": 2}, "fetched_from": {f"relay:{PEER[-8:]}": 25}}}
    assert unmapped(info) == []
    scraped = _scrape(info)
    assert scraped[("echo2swarm_policy_fetch_paths_total", (("path", "composite"),))] == 2
    assert scraped[("echo2swarm_policy_fetch_bytes_last", ())] == 25
    assert scraped[("echo2swarm_policy_heads_refused_total", (("reason", "delta_tensor_hash"),))] == 2
    assert not any(PEER[-8:] in v for _, labels in scraped for _, v in labels)
    assert {"echo2swarm_policy_fetch_paths_total", "echo2swarm_learner_versions_published_total"} <= set(families())
