"""The /metrics mapping on hand-made daemon state: names, types, labels, bounded label sets, step totals;
and the docs table and the Grafana dashboard against the families we export."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from echo2swarm.daemon.metric_names import PREFIX, families, sample_names, unmapped
from echo2swarm.daemon.prometheus import MAX_LABEL_VALUES, daemon_registry

REPO = Path(__file__).resolve().parents[3]
PARSED_TYPE = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "info": "gauge"}
PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBmGhKbbstVWx9S"


class Steps:
    """Step records as the learner's MetricsLog keeps them (its `recent` contract)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def recent(self, after_step: int | None = None, limit: int = 500) -> list[dict[str, Any]]:
        return [r for r in self.records if after_step is None or r["step"] > after_step][:limit]


def _learner_info(refused: dict[str, int]) -> dict[str, Any]:
    return {
        "peer_id": PEER, "role": "learner", "swarm": "s", "uptime_s": 12.5, "version": 4, "state": "ready",
        "fetching": None, "t_bcast_s": 0.5, "rollouts_per_s": None, "active": None, "bans": {PEER: "lied"},
        "arrival_s": {},
        "stats": {
            "published_version": 4, "steps_done": 3, "t_bcast_s": 0.5, "t_bcast": {"2": 0.4, "3": 0.5},
            "t_bcast_unreported": {}, "accepted": 30, "refused": refused, "dropped": {"stale": 2},
            "leases": {"leases": 9, "prompts_issued": 32, "prompts_completed": 30, "prompts_released": 1,
                       "leases_expired": 1, "leases_revoked": 2, "reissued": 3, "reissued_after_refusal": 1},
            "peers": {"tracked": 2, "probation": 1, "banned": {PEER: "lied"}, "bans": 1, "strike_verify_logprobs": 2,
                      "capped_probation": 4, "lapsed_leases": 1},
            "capacity": {"enabled": True, "planned": True, "rollouts_per_step": 32, "t_train": 0.15, "t_bcast": 0.5,
                         "l_gen": 0.03, "staleness": 2, "publish_every": 1, "gamma": 1.1, "delivered_mu": {PEER: 9.0},
                         "active": [PEER], "plan": {"floor": 7.5, "active_mu": 9.0, "bubble_predicted": 0.1},
                         "log": []},
            "rollbacks": 0,
            "server": {"bytes_served": 4096, "chunks_served": 2, "open_connections": 3, "open_control": 1,
                       "refused_control_per_client": 5, "refused_per_client": 5, "refused_404": 1},
            "dht_refused": 7,
        },
    }


def _rollout_info() -> dict[str, Any]:
    return {
        "peer_id": PEER, "role": "rollout", "swarm": "s", "uptime_s": 3.0, "version": 2, "active": False,
        "arrival_s": {"1": 0.5, "10": 0.25, "2": 0.75},
        "stats": {
            "worker": {"leases": 5, "tokens": 400, "generate_s": 2.0, "wait_s": 1.0, "starved_s": 0.5,
                       "refused_stale": 1, "refused_" + PEER: 1, "leases_abandoned": 1, "refits": 2},
            "rollouts_per_s": 12.5, "engine_version": 2, "swap_s": 0.01, "engine": "transformers", "refit_s": 0.02,
            "engine_pid": 123, "engine_restarts": 0, "engine_busy_s": {"generate": 1.5, "load": 0.1},
            "refused_heads": {"bad_signature": 1}, "fetching_version": None, "fetched_from": {f"rollout:{PEER[-8:]}": 9},
            "fetch": {"chunks_fetched": 3, "bytes_fetched": 3000, "source_busy": 2, "source_error": 1,
                      "hedges_fired": 3, "hedges_won": 2, "hedge_bytes": 120,
                      "source_too_slow": 1, "bans": 1, "bans_too_slow": 1, "parent_not_begun": 4,
                      "parent_passed_over": 1, "parent_unknown": 2, "parent_behind": 1, "parent_past": 1},
            "arrival_s": {"1": 0.5}, "trusted_key": "ed25519:00",
            "dht_refused": 0,
        },
    }


def _scrape(info: dict[str, Any], versions: list[int], steps: Steps | None = None) -> dict[str, Any]:
    registry = daemon_registry(lambda: info, lambda: versions, lambda: steps)
    return _parse(generate_latest(registry).decode())


def _parse(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(scraped: dict[str, Any], sample: str, **labels: str) -> float:
    return next(s.value for f in scraped.values() for s in f.samples if s.name == sample and s.labels == labels)


def _check_declared(scraped: dict[str, Any]) -> None:
    """Every echo2swarm family exported is declared, with its type and label; no peer id as a label."""
    declared = families()
    by_parsed_name = {name.removesuffix("_total") if f.kind == "counter" else name: (name, f) for name, f in declared.items()}
    for name, family in scraped.items():
        if not name.startswith(PREFIX):
            continue
        full, spec = by_parsed_name[name]
        assert family.type == PARSED_TYPE[spec.kind], name
        label_sets = {tuple(sorted(set(s.labels) - {"le"})) for s in family.samples}
        expected = {"daemon_info": ("role", "software", "swarm")}.get(spec.name, (spec.label,) if spec.label else ())
        assert label_sets == {expected}, (name, label_sets)
        assert len(family.samples) <= MAX_LABEL_VALUES + 1 or spec.kind == "histogram"
        for sample in family.samples:
            assert sample.name in sample_names(full, spec)
            assert not any("12D3" in v for v in sample.labels.values()), sample


def test_learner_state_maps_to_named_families_with_bounded_labels():
    refused = {"stale": 3, "duplicate": 1, "Bad Reason!": 2, **{f"r{i}": 1 for i in range(40)}}
    steps = Steps()
    steps.records = [
        {"step": 1, "time_s": 1.0, "wait_s": 0.75, "cost_usd": 0.001, "tokens": 100, "staleness": [0, 1, 1],
         "reward_mean": 0.25, "bubble_ratio": 0.75},
        {"step": 2, "time_s": 3.5, "wait_s": 0.5, "cost_usd": 0.002, "tokens": 120, "staleness": [2, 0],
         "reward_mean": 0.5, "bubble_ratio": 0.2},
    ]
    info = _learner_info(refused)
    assert unmapped(info) == []
    scraped = _scrape(info, [2, 3, 4], steps)
    _check_declared(scraped)
    assert scraped["echo2swarm_daemon_info"].samples[0].labels["role"] == "learner"
    assert _value(scraped, "echo2swarm_learner_steps_total") == 3
    assert _value(scraped, "echo2swarm_policy_version") == 4
    assert _value(scraped, "echo2swarm_policy_versions_held") == 3
    assert _value(scraped, "echo2swarm_learner_peers_banned") == 1
    assert _value(scraped, "echo2swarm_learner_leases_ended_total", reason="expired") == 1
    assert _value(scraped, "echo2swarm_learner_leases_ended_total", reason="revoked") == 2
    assert _value(scraped, "echo2swarm_learner_strikes_total", reason="verify_logprobs") == 2
    assert _value(scraped, "echo2swarm_learner_activation_planned") == 1
    assert _value(scraped, "echo2swarm_learner_rollouts_per_second_floor") == 7.5
    assert _value(scraped, "echo2swarm_server_sent_bytes_total") == 4096
    assert _value(scraped, "echo2swarm_server_refused_total", reason="control_per_client") == 5
    assert _value(scraped, "echo2swarm_server_budget_in_use", budget="connections") == 3
    assert _value(scraped, "echo2swarm_dht_records_refused_total") == 7
    # Refusal reasons: ours kept, an odd one and the ones past the cap folded into `other`, none lost.
    reasons = {s.labels["reason"]: s.value for s in scraped["echo2swarm_learner_groups_refused"].samples}
    assert len(reasons) <= MAX_LABEL_VALUES + 1 and reasons["stale"] == 3
    assert reasons["other"] == 2 + 11  # "Bad Reason!", and the 11 reasons past the cap
    assert sum(reasons.values()) == sum(refused.values())
    # Step records: totals, the step-time histogram (1.0 s, then 2.5 s), staleness buckets 0..S=2.
    assert _value(scraped, "echo2swarm_learner_wait_seconds_total") == 1.25
    assert _value(scraped, "echo2swarm_learner_trained_tokens_total") == 220
    assert _value(scraped, "echo2swarm_learner_reward") == 0.5
    assert _value(scraped, "echo2swarm_learner_step_seconds_count") == 2
    assert _value(scraped, "echo2swarm_learner_step_seconds_sum") == 3.5
    assert _value(scraped, "echo2swarm_learner_step_seconds_bucket", le="1.0") == 1
    assert _value(scraped, "echo2swarm_learner_step_seconds_bucket", le="2.5") == 2
    staleness = {s.labels["le"]: s.value for s in scraped["echo2swarm_learner_group_staleness"].samples
                 if s.name.endswith("_bucket")}
    assert staleness == {"0.0": 2, "1.0": 4, "2.0": 5, "+Inf": 5}
    # The next scrape adds only the new step: counters never count a record twice.
    steps.records.append({"step": 3, "time_s": 4.0, "wait_s": 0.25, "tokens": 10, "staleness": [0]})
    again = _scrape(info, [2, 3, 4], steps)
    assert _value(again, "echo2swarm_learner_trained_tokens_total") == 230  # a new registry: a fresh follower
    registry = daemon_registry(lambda: info, lambda: [4], lambda: steps)
    first, second = (_parse(generate_latest(registry).decode()) for _ in range(2))
    assert _value(first, "echo2swarm_learner_step_seconds_count") == _value(second, "echo2swarm_learner_step_seconds_count") == 3


def test_rollout_state_maps_to_named_families():
    info = _rollout_info()
    assert unmapped(info) == []
    scraped = _scrape(info, [1, 2])
    _check_declared(scraped)
    assert _value(scraped, "echo2swarm_policy_version_latest") == 2
    assert _value(scraped, "echo2swarm_policy_arrival_seconds") == 0.25  # of v10, the newest
    assert _value(scraped, "echo2swarm_rollout_active") == 0
    assert _value(scraped, "echo2swarm_rollout_engine_seconds_total", state="generating") == 2.0
    assert _value(scraped, "echo2swarm_rollout_engine_seconds_total", state="starved") == 0.5
    assert _value(scraped, "echo2swarm_rollout_engine_busy_seconds_total", work="load") == 0.1
    assert _value(scraped, "echo2swarm_rollout_groups_refused_total", reason="stale") == 1
    assert _value(scraped, "echo2swarm_rollout_groups_refused_total", reason="other") == 1  # a peer-id-shaped reason
    assert _value(scraped, "echo2swarm_rollout_refits_total", outcome="done") == 2
    assert _value(scraped, "echo2swarm_fetch_received_bytes_total") == 3000
    assert _value(scraped, "echo2swarm_fetch_source_failures_total", outcome="busy") == 2
    assert _value(scraped, "echo2swarm_fetch_source_faults_total", reason="too_slow") == 1
    assert _value(scraped, "echo2swarm_fetch_source_bans_total", reason="too_slow") == 1
    assert _value(scraped, "echo2swarm_fetch_plan_parent_events_total", event="not_begun") == 4
    assert _value(scraped, "echo2swarm_fetch_plan_parent_events_total", event="unknown") == 2
    assert _value(scraped, "echo2swarm_fetch_hedges_total", outcome="fired") == 3
    assert _value(scraped, "echo2swarm_fetch_hedges_total", outcome="won") == 2
    assert _value(scraped, "echo2swarm_fetch_hedge_discarded_bytes_total") == 120
    assert _value(scraped, "echo2swarm_policy_heads_refused_total", reason="bad_signature") == 1
    assert "echo2swarm_learner_step_seconds" not in scraped
    assert "process_resident_memory_bytes" in {s.name for f in scraped.values() for s in f.samples}


def test_a_new_counter_without_a_metric_is_reported():
    info = _rollout_info()
    info["stats"]["worker"]["shiny_new_counter"] = 1
    info["stats"]["brand_new"] = {"a": 1}
    info["stats"]["engine_restarts"] = {"oops": 1}
    assert unmapped(info) == ["stats.worker.shiny_new_counter", "stats.engine_restarts", "stats.brand_new"]


def _docs_table() -> dict[str, tuple[str, str]]:
    """name -> (type, labels) from the table under "## Prometheus metrics" in docs/operations.md."""
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("## Prometheus metrics", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(echo2swarm_[a-z0-9_]+)` \| (\w+) \| ([^|]*) \|", section, re.M)
    return {name: (kind, labels.strip()) for name, kind, labels in rows}


def test_the_docs_table_lists_every_family_with_its_type_and_label():
    table = _docs_table()
    declared = families()
    assert set(table) == set(declared)
    for name, family in declared.items():
        kind, labels = table[name]
        assert kind == family.kind, name
        want = "`role`, `software`, `swarm`" if family.kind == "info" else f"`{family.label}`" if family.label else ""
        assert labels == want, name


def test_the_grafana_dashboard_parses_and_queries_only_metrics_we_export():
    dashboard = json.loads((REPO / "docs" / "grafana" / "echo2swarm-dashboard.json").read_text())
    exported = {sample for name, f in families().items() for sample in sample_names(name, f)}
    exported |= {"process_resident_memory_bytes", "process_cpu_seconds_total"}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    for expr in exprs:
        used = set(re.findall(r"\b(?:echo2swarm|process)_[a-z0-9_]+", expr))
        assert used and used <= exported, (expr, used - exported)
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert "job" in variables or "instance" in variables
