"""Prometheus metrics of one daemon, read from its own state at scrape time: GET /metrics.

    GET /metrics ─► generate_latest(registry)
                      ├─ DaemonCollector ─► Daemon.info(): role stats, chunk server, fetcher, DHT refusals
                      │                 └─► learner: its step records since the last scrape (MetricsLog.recent)
                      └─ process_*, python_* (prometheus-client's own collectors)

Nothing is counted twice: the daemon's counters stay where they are (the /v1/info JSON), and this
module only names them, by the tables in `daemon/metric_names.py`. The one state kept between
scrapes is the learner's step totals (wait, cost, tokens, the step-time and staleness histograms),
followed record by record from the step log.

Cardinality stays bounded whatever peers send: labels come from sets our own code names (a reason,
a state, an outcome), never a peer id. As a backstop, against a counter keyed by what a peer sent
(a rollout peer counts the refusal reasons the learner answers), a label value outside
`[a-z0-9_]{1,40}`, or past MAX_LABEL_VALUES values in one family, is counted under `other`.
Back-pressure: a scrape is a control request of the daemon's HTTP server, inside its budget and
request timeout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from echo2swarm import __version__
from echo2swarm.daemon import metric_names as names
from echo2swarm.daemon.metric_names import PREFIX, Family, Section, number
from echo2swarm.policy.server import Handler

MAX_LABEL_VALUES = 32
OTHER = "other"
_LABEL_VALUE = re.compile(r"[a-z0-9_]{1,40}")
# Seconds a learner step takes, from a tiny model on a CPU to a large one on GPUs.
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
MAX_STALENESS_BUCKETS = 1024  # staleness is at most S; a larger number in a record is no bucket of its own
STEPS_PER_SCRAPE = 100_000  # step records read at most per scrape (the learner keeps its last 2000)


class StepLog(Protocol):
    """The learner's per-step records (`learner.metrics.MetricsLog`)."""

    def recent(self, after_step: int | None = None, limit: int = 500) -> list[dict[str, Any]]: ...


def label_value(raw: object) -> str:
    text = str(raw)
    return text if _LABEL_VALUE.fullmatch(text) else OTHER


class _Families:
    """The counter and gauge families of one scrape, values summed per (family, label value)."""

    def __init__(self) -> None:
        self.specs: dict[str, Family] = {}
        self.values: dict[str, dict[str | None, float]] = {}

    def add(self, family: Family, value: object, label: str | None = None) -> None:
        n = number(value)
        if n is None:
            return
        self.specs[family.name] = family
        if family.label is not None:
            label = label_value(label)
        values = self.values.setdefault(family.name, {})
        if label not in values and len(values) >= MAX_LABEL_VALUES:
            label = OTHER
        values[label] = values.get(label, 0.0) + n

    def section(self, section: Section, data: Mapping[str, Any]) -> None:
        for key, value in data.items():
            if key in section.ignore:
                continue
            if key in section.keys:
                family, label = section.keys[key]
                self.add(family, value, label)
            elif key in section.dicts and isinstance(value, Mapping):
                for label, count in value.items():
                    self.add(section.dicts[key], count, label)
            elif key in section.sections and isinstance(value, Mapping):
                self.section(section.sections[key], value)
            else:
                prefix = next((p for p in section.prefixes if key.startswith(p)), None)
                if prefix is not None:
                    self.add(section.prefixes[prefix], value, key[len(prefix):])

    def metrics(self) -> Iterator[Metric]:
        for name, values in self.values.items():
            spec = self.specs[name]
            kind = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            metric = kind(PREFIX + name, spec.doc, labels=[spec.label] if spec.label else [])
            for label, value in sorted(values.items(), key=lambda kv: kv[0] or ""):
                metric.add_metric([label] if spec.label else [], value)
            yield metric


@dataclass
class _StepTotals:
    """What the learner's step records add up to since this daemon started, followed scrape by scrape."""

    last_step: int | None = None
    last_time_s: float | None = None
    last: dict[str, Any] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    step_count: int = 0
    step_sum: float = 0.0
    step_buckets: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS))  # cumulative, as exposed
    staleness: dict[int, int] = field(default_factory=dict)

    def follow(self, log: StepLog) -> None:
        for record in log.recent(self.last_step, STEPS_PER_SCRAPE):
            self.add(record)

    def add(self, record: Mapping[str, Any]) -> None:
        time_s = number(record.get("time_s"))
        if time_s is not None:
            # time_s counts from the start of the training loop, which starts again if the service is restarted.
            since = self.last_time_s if self.last_time_s is not None and time_s >= self.last_time_s else 0.0
            seconds, self.last_time_s = time_s - since, time_s
            self.step_count += 1
            self.step_sum += seconds
            for i, bound in enumerate(STEP_BUCKETS):
                self.step_buckets[i] += int(seconds <= bound)
        for key in names.STEP_TOTALS:
            self.totals[key] = self.totals.get(key, 0.0) + (number(record.get(key)) or 0.0)
        for s in record.get("staleness") or []:
            if isinstance(s, int) and 0 <= s < MAX_STALENESS_BUCKETS:
                self.staleness[s] = self.staleness.get(s, 0) + 1
        if isinstance(record.get("step"), int):
            self.last_step = record["step"]
        self.last = dict(record)

    def metrics(self, staleness_limit: int | None) -> Iterator[Metric]:
        out = _Families()
        for key, family in names.STEP_TOTALS.items():
            out.add(family, self.totals.get(key, 0.0))
        for key, family in names.LAST_STEP.items():
            out.add(family, self.last.get(key))
        yield from out.metrics()
        buckets = [(floatToGoString(bound), n) for bound, n in zip(STEP_BUCKETS, self.step_buckets)]
        yield HistogramMetricFamily(PREFIX + names.STEP_SECONDS.name, names.STEP_SECONDS.doc,
                                    buckets=[*buckets, ("+Inf", self.step_count)], sum_value=self.step_sum)
        top = min(MAX_STALENESS_BUCKETS - 1, max([staleness_limit or 0, *self.staleness]))
        cumulative, buckets = 0, []
        for s in range(top + 1):
            cumulative += self.staleness.get(s, 0)
            buckets.append((floatToGoString(s), cumulative))
        yield HistogramMetricFamily(PREFIX + names.GROUP_STALENESS.name, names.GROUP_STALENESS.doc,
                                    buckets=[*buckets, ("+Inf", cumulative)],
                                    sum_value=float(sum(s * n for s, n in self.staleness.items())))


class DaemonCollector(Collector):
    """Reads the daemon at each scrape; keeps only the learner's step totals between scrapes.

    >>> registry = daemon_registry(daemon.info, versions=store.versions)
    >>> generate_latest(registry)   # b'# HELP echo2swarm_daemon_info ...'
    """

    def __init__(self, info: Callable[[], Mapping[str, Any]], versions: Callable[[], Iterable[int]] = list,
                 step_log: Callable[[], StepLog | None] = lambda: None):
        self.info = info
        self.versions = versions
        self.step_log = step_log
        self._steps = _StepTotals()

    def describe(self) -> list[Metric]:
        return []  # nothing to collect at registration: the daemon is not up yet

    def collect(self) -> Iterator[Metric]:
        info = self.info()
        stats = info.get("stats") or {}
        role = label_value(info.get("role", ""))
        daemon = InfoMetricFamily(PREFIX + names.DAEMON_INFO.name.removesuffix("_info"), names.DAEMON_INFO.doc)
        daemon.add_metric([], {"role": role, "software": __version__, "swarm": str(info.get("swarm", ""))[:64]})
        yield daemon
        out = _Families()
        out.add(names.UPTIME, info.get("uptime_s"))
        out.add(names.POLICY_VERSION, info.get("version"))
        held = sorted(self.versions())
        out.add(names.VERSIONS_HELD, len(held))
        if held:
            out.add(names.VERSION_LATEST, held[-1])
        arrivals = info.get("arrival_s")
        if isinstance(arrivals, Mapping) and arrivals:
            newest = max(arrivals, key=lambda v: int(v) if str(v).isdigit() else -1)
            out.add(names.ARRIVAL, arrivals[newest])
        out.add(names.ROLLOUT_ACTIVE, info.get("active"))
        if role == "learner":
            out.add(names.PEERS_BANNED, len(info.get("bans") or {}))
            plan = (stats.get("capacity") or {}).get("plan") or {}
            for key, family in names.PLAN.items():
                out.add(family, plan.get(key))
        out.section(names.STATS, stats)
        yield from out.metrics()
        log = self.step_log()
        if log is not None:
            self._steps.follow(log)
            limit = (stats.get("capacity") or {}).get("staleness")
            yield from self._steps.metrics(limit if isinstance(limit, int) else None)


def daemon_registry(info: Callable[[], Mapping[str, Any]], versions: Callable[[], Iterable[int]] = list,
                    step_log: Callable[[], StepLog | None] = lambda: None) -> CollectorRegistry:
    """A registry of the daemon's own (not prometheus-client's global one): its metrics, the process's
    (`process_*`: CPU, memory, open files) and the interpreter's (`python_*`: GC, version)."""
    registry = CollectorRegistry()
    registry.register(DaemonCollector(info, versions, step_log))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def metrics_route(registry: CollectorRegistry) -> tuple[str, Handler]:
    """GET /metrics in Prometheus' text format, for the daemon's HTTP server."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return "/metrics", metrics
