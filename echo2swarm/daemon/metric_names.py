"""Which number of a daemon's state becomes which Prometheus metric: the names, types, labels and help.

    /v1/info JSON ─► STATS (tables of Sections, one per object: keys, prefixes, dicts, nested) ─► Family
    daemon fields, the learner's step records ─► DAEMON, STEP_TOTALS, LAST_STEP, HISTOGRAMS ─► Family

One table per producer of counters (chunk server, fetcher, rollout worker, learner intake, leases,
ledger, capacity), so a counter added there has one obvious place here. `unmapped(info)` lists every
number in /v1/info that no table names (a test runs it against real daemons), and `families()` is
the complete list the docs table and the Grafana dashboard are checked against.

Names follow Prometheus' conventions: the `echo2swarm_` prefix, base units in the name (`_seconds`,
`_bytes`, `_usd`), `_total` on counters, and one label at most, over a set our own code bounds
(a reason, a state, an outcome); never a peer id.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

PREFIX = "echo2swarm_"


def number(value: object) -> float | None:
    """A JSON number (booleans as 0/1), else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


@dataclass(frozen=True)
class Family:
    """One metric family: `name` without the prefix (counters end in `_total`), and its label, if any."""

    name: str
    kind: Literal["counter", "gauge", "histogram", "info"]
    doc: str
    label: str | None = None


def counter(name: str, doc: str, label: str | None = None) -> Family:
    return Family(name, "counter", doc, label)


def gauge(name: str, doc: str, label: str | None = None) -> Family:
    return Family(name, "gauge", doc, label)


@dataclass(frozen=True)
class Section:
    """How one JSON object of /v1/info becomes metrics.

    `keys`: key -> (family, label value or None). `prefixes`: keys starting with the prefix feed the
    family, the rest of the key is the label value (`refused_busy` -> reason="busy"). `dicts`: the
    value is itself an object of counts by label value (`refused: {"stale": 3}`). `sections`: nested
    objects. `ignore`: keys that are no metric (text, per-peer maps, sums of other keys).
    """

    keys: Mapping[str, tuple[Family, str | None]] = field(default_factory=dict)
    prefixes: Mapping[str, Family] = field(default_factory=dict)
    dicts: Mapping[str, Family] = field(default_factory=dict)
    sections: Mapping[str, Section] = field(default_factory=dict)
    ignore: frozenset[str] = frozenset()


def _one(family: Family) -> tuple[Family, None]:
    return family, None


# -- the chunk server (every daemon with one; stats.server) -------------------------------------
SERVER_REFUSED = counter("server_refused_total", "Requests the HTTP and libp2p chunk server refused, by reason: a "
                         "budget full (`<budget>` for everyone not seen working, `<budget>_reserve` for working peers "
                         "too, `<budget>_per_client` for one client), `auth_forged` or `auth_replayed` (a credential, "
                         "401), `body`, or an HTTP status (`404`: not held).", "reason")
SERVER = Section(
    keys={
        "bytes_served": _one(counter("server_sent_bytes_total", "Chunk bytes this daemon uploaded to other peers.")),
        "chunks_served": _one(counter("server_sent_chunks_total", "Chunks this daemon uploaded to other peers.")),
        "manifests_served": _one(counter("server_sent_manifests_total", "Signed manifests this daemon served.")),
        "waited": _one(counter("server_held_requests_total",
                               "Chunk requests held until the chunk of the version in flight arrived.")),
        "head_waited": _one(counter("server_held_head_requests_total",
                                    "Head long-polls held until a newer head was out (or their wait ended).")),
        "wait_unseen": _one(counter("server_unseen_version_requests_total",
                                    "Chunk requests naming a version this daemon has not seen signed (answered at once).")),
        "dropped_connections": _one(counter("server_dropped_connections_total",
                                            "Connections dropped unread (closed after Retry-After): past twice a "
                                            "connection cap.")),
        "p2p_refused": _one(counter("server_p2p_refused_total",
                                    "libp2p chunk requests refused (also counted by reason in server_refused_total).")),
        "uplink_bps": _one(gauge("server_uplink_bytes_per_second", "Upload bytes/s this daemon's uploads sustained "
                                 "while busy (measured; absent until measured).")),
        "working_peers": _one(gauge("server_working_peers", "Peers seen working lately (groups the learner accepted, "
                                    "whole versions fetched here): who may take the budgets' reserves.")),
        "paced_refusals": _one(counter("server_paced_refusals_total", "HTTP refusals (held requests, connections "
                                       "past a cap) answered only once the client's last Retry-After was up.")),
        "promoted_connections": _one(counter("server_promoted_connections_total", "HTTP connections past the "
                                             "others' share kept for a working peer whose credential came first.")),
        "chunks_from_files": _one(counter("server_chunks_from_files_total", "Chunks copied from installed versions' "
                                          "files to be served: a path this daemon did not fetch (the dense files "
                                          "it rebuilt from a delta).")),
    },
    prefixes={
        "open_": gauge("server_budget_in_use", "Units of each chunk-server budget in use now "
                       "(connections, streams, control, waiting, uploads).", "budget"),
        "working_open_": gauge("server_working_budget_in_use", "Units of each budget with a reserve (connections, "
                               "streams, waiting) held by peers seen working now.", "budget"),
        "working_seen_": counter("server_working_seen_total", "Times a peer was seen working, by how: `delivery` "
                                 "(groups the learner accepted), `fetch` (a whole version's worth fetched here).", "how"),
        "auth_": counter("server_credentials_total", "HTTP request credentials (X-E2S-Peer) checked, by outcome: ok, "
                         "malformed, stale, forged, replayed.", "outcome"),
        "refused_": SERVER_REFUSED,
    },
    # the 503s and 429s among the reasons; the busy windows behind uplink_bps (a list)
    ignore=frozenset({"refused_busy", "refused_per_client", "uplink_windows"}),
)

# -- the policy follower (rollout and relay peers) ---------------------------------------------
SOURCE_FAILURES = counter("fetch_source_failures_total", "Chunk and manifest requests a source did not answer with "
                          "the bytes: busy (its budget was full), unreachable, missing (not held), error.", "outcome")
PLAN_PARENT = counter("fetch_plan_parent_events_total", "What happened with plan parents: not_begun (a parent that "
                      "had not begun the version, asked again), passed_over (a parent given up on after "
                      "fetch.source_wait_s), unknown (the plan named a parent with no card yet: the card read was "
                      "awaited), behind (its card showed it catching up, over 3 versions back: not waited for), past (its card "
                      "showed it on a newer version, neither holding nor fetching this one: not waited for), card_fallback (a "
                      "parent's or foster parent's card not found under its own key: the card shards read for it).",
                      "event")
HEDGES = counter("fetch_hedges_total", "Hedged chunk and manifest requests: fired (another source asked beside a "
                 "request that ran past fetch.hedge_after x the recent median chunk time), won (the hedge's copy was "
                 "kept).", "outcome")
FETCH = Section(
    keys={
        "bytes_fetched": _one(counter("fetch_received_bytes_total", "Verified chunk bytes fetched from other peers.")),
        "chunks_fetched": _one(counter("fetch_chunks_total", "Verified chunks fetched from other peers.")),
        "bad_chunk": _one(counter("fetch_bad_chunks_total", "Chunks that did not match their hash (source banned).")),
        "source_off_path": _one(counter("fetch_off_path_answers_total", "Of the missing answers, those of sources on "
                                        "another path of the version (gone around, not asked again that fetch).")),
        **{f"source_{outcome}": (SOURCE_FAILURES, outcome) for outcome in ("busy", "unreachable", "missing", "error")},
        **{f"parent_{event}": (PLAN_PARENT, event) for event in ("not_begun", "passed_over", "unknown", "behind", "past",
                                                                               "card_fallback")},
        **{f"hedges_{outcome}": (HEDGES, outcome) for outcome in ("fired", "won")},
        "hedge_bytes": _one(counter("fetch_hedge_discarded_bytes_total", "Bytes received by requests cancelled "
                                    "because another copy won the race (duplicates; not in fetch_received_bytes_total).")),
    },
    prefixes={
        "source_": counter("fetch_source_faults_total",
                           "Source errors by what the source did (among outcome=\"error\").", "reason"),
        "manifest_": counter("fetch_manifests_refused_total", "Manifests refused, by reason.", "reason"),
        "bans_": counter("fetch_source_bans_total", "Sources banned for misbehaving, by reason.", "reason"),
        "learner_backoffs_": counter("fetch_learner_backoffs_total",
                                     "Times the learner's own source was paused, by reason.", "reason"),
    },
    ignore=frozenset({"bans", "learner_backoffs"}),  # the sums of their reasons
)

# -- the rollout worker (stats.worker) ----------------------------------------------------------
ENGINE_SECONDS = counter("rollout_engine_seconds_total", "Seconds of the engine's time by state: generating (a batch "
                         "in the engine), waiting (the learner had no work for this peer), starved (anything else).",
                         "state")
RPC_SECONDS = counter("rollout_rpc_seconds_total", "Seconds spent in lease and submit RPCs to the learner.", "rpc")
LEASES_LOST = counter("rollout_leases_lost_total", "Leases this peer never delivered: abandoned (could not serve it) "
                      "or expired before it was generated.", "reason")
REFITS = counter("rollout_refits_total", "New policy versions loaded into the engine (done), put off to keep "
                 "refits within worker.max_refit_share (deferred), or failed.", "outcome")
WORKER = Section(
    keys={
        "leases": _one(counter("rollout_leases_total", "Leases received from the learner.")),
        "waits": _one(counter("rollout_lease_waits_total", "Lease requests the learner answered with a wait.")),
        "rpc_errors": _one(counter("rollout_rpc_errors_total", "Lease and submit RPCs that failed.")),
        "batches": _one(counter("rollout_batches_total", "Batches generated.")),
        "rollouts": _one(counter("rollout_rollouts_total", "Completions generated.")),
        "tokens": _one(counter("rollout_tokens_total", "Tokens generated; rate() of it is the engine's tokens/s.")),
        "groups_accepted": _one(counter("rollout_groups_accepted_total", "Groups the learner accepted.")),
        "groups_unsent": _one(counter("rollout_groups_unsent_total", "Groups generated but never delivered.")),
        "engine_errors": _one(counter("rollout_engine_errors_total", "Batches or loads the engine failed.")),
        "version_wait_s": _one(counter("rollout_version_wait_seconds_total",
                                       "Seconds leases waited for the policy version they need.")),
        "generate_s": (ENGINE_SECONDS, "generating"),
        "wait_s": (ENGINE_SECONDS, "waiting"),
        "starved_s": (ENGINE_SECONDS, "starved"),
        "lease_rpc_s": (RPC_SECONDS, "lease"),
        "submit_rpc_s": (RPC_SECONDS, "submit"),
        "leases_abandoned": (LEASES_LOST, "abandoned"),
        "leases_expired": (LEASES_LOST, "expired"),
        "refits": (REFITS, "done"),
        "refits_deferred": (REFITS, "deferred"),
        "refits_failed": (REFITS, "failed"),
    },
    prefixes={"refused_": counter("rollout_groups_refused_total", "Groups the learner refused, by its reason.",
                                  "reason")},
)

# -- the learner --------------------------------------------------------------------------------
LEASES_ENDED = counter("learner_leases_ended_total", "Leases closed before they were delivered: expired (past their "
                       "deadline) or revoked (the peer left or was banned); their prompts are issued again.", "reason")
LEASES = Section(keys={
    "leases": _one(counter("learner_leases_issued_total", "Leases issued to rollout peers.")),
    "prompts_issued": _one(counter("learner_prompts_issued_total", "Prompts issued in leases (one group each).")),
    "prompts_completed": _one(counter("learner_prompts_completed_total", "Prompts whose group was delivered and accepted.")),
    "reissued": _one(counter("learner_prompts_reissued_total", "Prompts issued again after their lease ended.")),
    "prompts_released": _one(counter("learner_prompts_released_total", "Prompts given back at once after a group "
                                     "too stale to train or not drawn with the lease's seeded sampler.")),
    "reissued_after_refusal": _one(counter("learner_prompts_requeued_total",
                                           "Prompts of groups thrown away (a banned peer's, or refused by "
                                           "verification) put back to be issued again.")),
    "leases_expired": (LEASES_ENDED, "expired"),
    "leases_revoked": (LEASES_ENDED, "revoked"),
})
LEASES_CAPPED = counter("learner_lease_requests_capped_total", "Lease requests answered with a wait because the peer "
                        "held too much undelivered work (open_leases, undelivered, probation) or the newcomers' "
                        "shared pool was taken (newcomer_pool).", "reason")
FORGOTTEN = counter("learner_ledger_forgotten_total", "Ledger entries dropped to bound its memory (bans, peers).", "what")
LEDGER = Section(
    keys={
        "tracked": _one(gauge("learner_peers_tracked", "Peers the learner's ledger tracks.")),
        "probation": _one(gauge("learner_peers_on_probation",
                                "Tracked peers on probation: fewer verified groups than peers.graduate_after_groups.")),
        "graduated": _one(counter("learner_peers_graduated_total", "Peers whose verified groups ended their probation.")),
        "bans": _one(counter("learner_bans_total", "Peers banned for the run.")),
        "lapsed_leases": _one(counter("learner_leases_lapsed_total", "Leases the ledger counted as lapsed.")),
        "held_requests_refused": _one(counter("learner_lease_requests_not_held_total",
                                              "Lease requests answered at once: the peer already had its share held.")),
        "verify_atypical": _one(counter("learner_groups_atypical_total",
                                        "Groups refused as atypical text (statistical; no strike).")),
        "capped_open_leases": (LEASES_CAPPED, "open_leases"),
        "capped_undelivered": (LEASES_CAPPED, "undelivered"),
        "capped_probation": (LEASES_CAPPED, "probation"),
        "newcomer_pool_full": (LEASES_CAPPED, "newcomer_pool"),
        "bans_forgotten": (FORGOTTEN, "bans"),
        "peers_forgotten": (FORGOTTEN, "peers"),
    },
    prefixes={"strike_": counter("learner_strikes_total", "Strikes against peers, by reason.", "reason")},
    ignore=frozenset({"banned"}),  # per peer: /v1/info and `echo2swarm peers`; the count is learner_peers_banned
)
CAPACITY = Section(
    keys={
        "t_train": _one(gauge("learner_train_seconds", "T_train: the learner's busy seconds per step (moving average).")),
        "l_gen": _one(gauge("learner_generation_latency_seconds",
                            "L_gen: seconds from a lease's issue to its delivery (moving average).")),
        "rollouts_per_step": _one(gauge("learner_rollouts_per_step", "R: rollouts one step trains on.")),
        "staleness": _one(gauge("learner_staleness_limit", "S: a group of version x trains step t only if t - x <= S.")),
        "publish_every": _one(gauge("learner_publish_period_steps", "kappa: a version is published every this many steps.")),
        "gamma": _one(gauge("learner_activation_gamma", "gamma: the activation's safety factor on the rollout floor.")),
        "planned": _one(gauge("learner_activation_planned",
                              "1 while cost-aware activation runs a feasible plan, 0 while everyone works.")),
        "quiet_events": _one(counter("learner_activation_quiet_total",
                                     "Planned peers dropped from the plan for going quiet.")),
    },
    # per peer or text (the plan's figures come from DaemonCollector), and t_bcast: learner_broadcast_seconds
    ignore=frozenset({"enabled", "delivered_mu", "active", "plan", "log", "t_bcast"}),
)
PUBLISH = Section(  # stats.publish: the newest version the learner published
    keys={
        "dense_bytes": _one(gauge("learner_version_dense_bytes", "Bytes of the newest version's dense weights.")),
        "delta_bytes": _one(gauge("learner_version_delta_bytes", "Bytes of the newest version's delta from the "
                                  "version before it (absent for the first).")),
        "composite_bytes": _one(gauge("learner_version_composite_bytes", "Bytes of the newest version's composite "
                                      "delta from its keyframe (absent when none was offered).")),
        "delta_ratio": _one(gauge("learner_version_delta_ratio", "Dense bytes over delta bytes of the newest version.")),
    },
    dicts={"kinds": counter("learner_versions_published_total", "Versions published, by kind: dense (keyframes) "
                            "or delta.", "kind")},
)
REMOTE_CHECKS = counter("learner_remote_checks_total", "Exact checks the learner sent to verifier daemons, by "
                        "outcome: asked, answered, none_answered, no_room (the device had no room: a verifier was "
                        "asked), declined_room (room enough: computed here), failed, skipped (resting after a "
                        "failure).", "outcome")
VERIFIERS = Section(
    keys={**{outcome: (REMOTE_CHECKS, outcome)
             for outcome in ("asked", "answered", "none_answered", "no_room", "declined_room", "failed", "skipped")},
          "wait_s": _one(counter("learner_remote_check_wait_seconds_total",
                                 "Seconds the trainer waited on verifier daemons for exact checks."))},
    prefixes={"refused_": counter("learner_remote_checks_refused_total", "Exact checks verifier daemons refused, "
                                  "by reason (not_listed, not_held, busy, failed).", "reason")},
    ignore=frozenset({"offload", "by_peer"}),  # the setting; per verifier: /v1/info
)
LEARNER = Section(
    keys={
        "steps_done": _one(counter("learner_steps_total", "Training steps done.")),
        "accepted": _one(counter("learner_groups_accepted_total", "Groups accepted (rewarded and buffered).")),
        "rollbacks": _one(counter("learner_rollbacks_total", "Times the policy went non-finite and was rolled back.")),
        "t_bcast_s": _one(gauge("learner_broadcast_seconds",
                                "T_bcast: seconds until the newest measured version reached the planned peers.")),
    },
    dicts={
        "refused": counter("learner_groups_refused_total", "Groups refused at intake, by reason.", "reason"),
        "dropped": counter("learner_groups_dropped_total", "Accepted groups dropped unused: stale (past S), "
                           "overflow, banned.", "reason"),
    },
    sections={"leases": LEASES, "peers": LEDGER, "capacity": CAPACITY, "publish": PUBLISH, "verifiers": VERIFIERS},
    # versions: per version (/v1/info and `peers`); the newest one's figures are under publish
    ignore=frozenset({"published_version", "t_bcast", "t_bcast_unreported", "versions"}),
)

# -- rollout, relay and verifier peers -------------------------------------------------------------
CHECKS = Section(  # a verifier daemon's exact checks for its learner (stats.checks)
    keys={
        "served": _one(counter("verifier_checks_served_total", "Exact checks this verifier computed for its learner.")),
        "rows": _one(counter("verifier_check_rows_total", "Completions (rows) in those checks.")),
        "tokens": _one(counter("verifier_check_tokens_total", "Prompt and completion tokens in those checks.")),
        "compute_s": _one(counter("verifier_check_seconds_total", "Seconds of those checks' forwards.")),
        "waiting": _one(gauge("verifier_checks_waiting", "Checks queued behind the one running.")),
    },
    prefixes={"refused_": counter("verifier_checks_refused_total", "Exact checks refused, by reason: not_listed (the "
                                  "caller is not the learner whose head lists us), not_held, busy, failed.", "reason")},
    ignore=frozenset({"device"}),
)
FOLLOWER = Section(
    keys={
        "rollouts_per_s": _one(gauge("rollout_rollouts_per_second", "mu: this peer's measured rollouts per second.")),
        "engine_version": _one(gauge("rollout_engine_version", "The policy version the engine generates with.")),
        "engine_restarts": _one(counter("rollout_engine_restarts_total", "Times the engine process was replaced.")),
        "refit_s": _one(gauge("rollout_refit_seconds", "Seconds the last load of a version into the engine took.")),
        "swap_s": _one(gauge("rollout_swap_seconds", "Seconds the last swap of a version into the engine took.")),
        "fetching_version": _one(gauge("policy_fetching_version", "The version being fetched (absent when none).")),
        "fetch_bytes_last": _one(gauge("policy_fetch_bytes_last", "Bytes fetched to install the newest version "
                                       "(every hop of its path).")),
    },
    dicts={"refused_heads": counter("policy_heads_refused_total", "Policy heads refused, by reason (delta_*: a "
                                    "rebuilt version did not match its signed tensor hashes).", "reason"),
           "fetch_paths": counter("policy_fetch_paths_total", "Versions installed, by path: delta (one delta from "
                                  "the version held), chain (several), composite, keyframe (dense).", "path"),
           "engine_busy_s": counter("rollout_engine_busy_seconds_total", "The engine's own compute seconds, by work: "
                                    "generate, load (new weights).", "work")},
    sections={"worker": WORKER, "fetch": FETCH, "checks": CHECKS},
    ignore=frozenset({"engine", "engine_pid", "fetched_from", "arrival_s", "trusted_key", "fetch_path_of"}),
)

# Under "stats" in /v1/info, whatever the role: the role's own keys, the chunk server's, the DHT's.
STATS = Section(
    keys={**LEARNER.keys, **FOLLOWER.keys,
          "dht_refused": _one(counter("dht_records_refused_total", "DHT records this node refused to store or use."))},
    dicts={**LEARNER.dicts, **FOLLOWER.dicts,
           "dht_requests": counter("dht_requests_total", "DHT requests this node sent and served, by direction and "
                                   "RPC (sent_find, served_store, ...).", "rpc"),
           "dht_bytes": counter("dht_bytes_total", "Bytes of those DHT requests and their replies (protobuf sizes), "
                                "by direction and RPC.", "rpc"),
           "card_reads": counter("card_reads_total", "Peer card reads: calls, shared (card shards read), "
                                 "named (reads of named peers only), own_keys (cards read by "
                                 "their own keys), timed_out (DHT reads given up after 4 x overlay.dht_timeout_s, or "
                                 "not begun while 8 such are stuck: finding nothing).", "kind")},
    sections={**LEARNER.sections, **FOLLOWER.sections, "server": SERVER},
    ignore=LEARNER.ignore | FOLLOWER.ignore,
)


# -- read by DaemonCollector from the daemon itself (not from a stats table) ----------------------
DAEMON_INFO = Family("daemon_info", "info", "The daemon's role, software version and swarm (labels role, software, swarm).")
UPTIME = gauge("uptime_seconds", "Seconds since the daemon started.")
POLICY_VERSION = gauge("policy_version", "The policy version this daemon announces: held (followers) or published "
                       "(the learner).")
VERSIONS_HELD = gauge("policy_versions_held", "Policy versions installed in this daemon's store.")
VERSION_LATEST = gauge("policy_version_latest", "The newest policy version installed in the store.")
ARRIVAL = gauge("policy_arrival_seconds", "Seconds the newest version took to arrive here.")
ROLLOUT_ACTIVE = gauge("rollout_active", "1 while the learner keeps this rollout peer active, 0 on standby.")
PEERS_BANNED = gauge("learner_peers_banned", "Peers banned for the run.")
PLAN = {  # stats.capacity.plan: the activation's last plan
    "floor": gauge("learner_rollouts_per_second_floor", "The rollouts/s the active set must reach (gamma * R / T_train)."),
    "active_mu": gauge("learner_active_rollouts_per_second", "Summed measured rollouts/s of the active set."),
    "bubble_predicted": gauge("learner_bubble_ratio_predicted", "The bubble ratio the capacity model predicts."),
}
DAEMON = (DAEMON_INFO, UPTIME, POLICY_VERSION, VERSIONS_HELD, VERSION_LATEST, ARRIVAL, ROLLOUT_ACTIVE, PEERS_BANNED,
          *PLAN.values())

# -- the learner's step records (metrics.jsonl), followed scrape by scrape ------------------------
STEP_TOTALS = {  # summed over every step since the daemon started
    "wait_s": counter("learner_wait_seconds_total", "Seconds the learner waited for rollouts (the bubble); rate() of "
                      "it over rate(echo2swarm_learner_step_seconds_sum) is the bubble ratio."),
    "cost_usd": counter("learner_cost_usd_total", "USD the active rollout peers cost while the learner stepped "
                        "(their advertised prices times step time)."),
    "tokens": counter("learner_trained_tokens_total", "Completion tokens trained on."),
}
STEP_SECONDS = Family("learner_step_seconds", "histogram", "Wall seconds per training step, waiting included.")
GROUP_STALENESS = Family("learner_group_staleness", "histogram", "Staleness t - x of the groups trained, in steps "
                         "(one bucket per step, 0..S).")
HISTOGRAMS = (STEP_SECONDS, GROUP_STALENESS)

# The last step's figures, as gauges (one step is noisy: STEP_TOTALS give rates over a window).
LAST_STEP = {
    "reward_mean": gauge("learner_reward", "Mean reward of the last step's groups."),
    "reward_std": gauge("learner_reward_std", "Standard deviation of the last step's rewards."),
    "bubble_ratio": gauge("learner_bubble_ratio", "Share of the last step's wall time spent waiting for rollouts."),
    "bubble_ratio_total": gauge("learner_bubble_ratio_run", "Share of the run's wall time spent waiting for rollouts."),
    "cost_usd": gauge("learner_step_cost_usd", "USD the active rollout peers cost during the last step."),
    "active_price_per_h": gauge("learner_active_price_usd_per_hour", "Summed price of the active rollout peers."),
    "active_peers": gauge("learner_active_peers", "Rollout peers the activation keeps active."),
    "loss": gauge("learner_loss", "The last step's GRPO loss."),
    "kl": gauge("learner_kl", "The last step's KL estimate to the reference."),
    "tokens_per_s": gauge("learner_tokens_per_second", "Completion tokens trained per second in the last step."),
    "t_publish_s": gauge("learner_publish_seconds", "Seconds the last step spent publishing a version (0: none)."),
}


def _walk(section: Section) -> list[Family]:
    out = [family for family, _ in section.keys.values()] + list(section.prefixes.values()) + list(section.dicts.values())
    for sub in section.sections.values():
        out += _walk(sub)
    return out


def families() -> dict[str, Family]:
    """Every family a daemon may export, by full name (`echo2swarm_...`)."""
    out: dict[str, Family] = {}
    for family in [*_walk(STATS), *DAEMON, *STEP_TOTALS.values(), *LAST_STEP.values(), *HISTOGRAMS]:
        known = out.setdefault(PREFIX + family.name, family)
        assert (known.kind, known.label) == (family.kind, family.label), f"two families named {family.name}"
    return out


def sample_names(family_name: str, family: Family) -> list[str]:
    """The sample names a family shows in the text format (`_bucket`, `_sum`, `_count` for histograms)."""
    if family.kind == "histogram":
        return [family_name + suffix for suffix in ("_bucket", "_sum", "_count")]
    return [family_name]


def unmapped(info: Mapping[str, Any]) -> list[str]:
    """Numbers in /v1/info's `stats` that no table turns into a metric (dotted paths): should be none."""
    out: list[str] = []

    def walk(section: Section, data: Mapping[str, Any], path: str) -> None:
        for key, value in data.items():
            where = f"{path}{key}"
            if key in section.keys and value is not None and number(value) is None:
                out.append(where)  # named, but not a number: it would go missing
            if key in section.ignore or key in section.keys or key in section.dicts:
                continue
            if key in section.sections and isinstance(value, Mapping):
                walk(section.sections[key], value, where + ".")
            elif not any(key.startswith(prefix) for prefix in section.prefixes) and number(value) is not None:
                out.append(where)
            elif isinstance(value, Mapping) and key not in section.sections:
                out.append(where)

    walk(STATS, info.get("stats", {}), "stats.")
    return out
