"""The learner's live swarm page: GET / and the JSON it reads, on the learner's HTTP server.

    browser ─GET /──────────────► static/live.html (inline CSS and JS; no build step, no CDN)
            └─every 2 s─► /v1/info            the learner's stats: capacity plan, T_bcast per version
                          /v1/peers           the cards the learner read last, with what it measured of each peer
                          /v1/steps?after=N   the step records it keeps in memory, numbers only

Read-only: no handler here changes the learner. Every answer is made from memory the learner
keeps anyway and is bounded whatever the clients do: at most MAX_PEER_ROWS peers (built at most
once per PEERS_CACHE_S, whatever the number of clients), at most STEPS_LIMIT step records of
STEP_FIELDS numbers each; queries are validated (400 with what to change). The chunk server
answers every one of these routes from its `control` budget, under its request timeout.

Peer cards are signed by strangers: every string in them is data. The page writes peer data with
`textContent` only, and its Content-Security-Policy allows no script but its own (by hash), no
connection but to this server, and no HTML sink at all (Trusted Types with no policy).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import time
from collections.abc import Callable
from importlib import resources
from typing import Any, Protocol

from aiohttp import web

from echo2swarm.config.rl import TrainConfig
from echo2swarm.learner.activation_loop import LearnerActivation
from echo2swarm.learner.broadcast_tracker import BroadcastTracker
from echo2swarm.learner.intake import Intake
from echo2swarm.learner.metrics import MetricsLog
from echo2swarm.learner.versions import PublishedVersion
from echo2swarm.policy.server import Handler

STEPS_LIMIT = 500  # most step records in one /v1/steps answer (the metrics log keeps the last 2000)
MAX_PEER_ROWS = 512  # most peers in one /v1/peers answer (overlay.max_cards may allow more cards)
PEERS_CACHE_S = 1.0  # /v1/peers is rebuilt at most this often
MAX_STEP = 10**12
# What the page draws of each step record (learner/metrics.py writes them; learner/loop.py names them).
STEP_FIELDS = (
    "step", "version", "published_version", "time_s", "reward_mean", "reward_std", "loss", "kl",
    "bubble_ratio", "bubble_ratio_total", "wait_s", "t_train_s", "t_bcast_s", "cost_usd", "active_peers",
    "active_price_per_h", "tokens_per_s", "accepted",
)
_ROLE_ORDER = {"learner": 0, "rollout": 1, "relay": 2, "verifier": 3, "bootstrap": 4}
_COUNT = re.compile(r"0|[1-9][0-9]{0,12}")
_JSON_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


class LearnerView(Protocol):
    """What the page reads of the learner (learner/loop.py), never writes."""

    broadcast: BroadcastTracker
    activation: LearnerActivation
    intake: Intake | None
    published: PublishedVersion | None
    metrics: MetricsLog | None
    train: TrainConfig
    steps_done: int


def routes(service: LearnerView) -> list[tuple[str, Handler]]:
    """GET routes the learner's HTTP server adds: the page and the JSON it reads besides /v1/info."""
    page = LivePage(service)
    return [("/", page.index), ("/v1/peers", page.peers), ("/v1/steps", page.steps)]


class LivePage:
    """>>> page = LivePage(service); app.router.add_get("/v1/steps", page.steps)"""

    def __init__(self, service: LearnerView, clock: Callable[[], float] = time.monotonic):
        self.service = service
        self.clock = clock
        self.html = resources.files("echo2swarm.daemon").joinpath("static/live.html").read_bytes()
        self.headers = {"Content-Security-Policy": content_security_policy(self.html.decode()),
                        "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", **_JSON_HEADERS}
        self._peers: tuple[float, bytes] | None = None  # (built at, body)

    async def index(self, request: web.Request) -> web.Response:
        return web.Response(body=self.html, content_type="text/html", charset="utf-8", headers=self.headers)

    async def peers(self, request: web.Request) -> web.Response:
        if request.query:
            raise web.HTTPBadRequest(text="/v1/peers takes no query parameters")
        now = self.clock()
        if self._peers is None or now - self._peers[0] >= PEERS_CACHE_S:
            self._peers = (now, _dumps(peer_view(self.service)))
        return web.Response(body=self._peers[1], content_type="application/json", headers=_JSON_HEADERS)

    async def steps(self, request: web.Request) -> web.Response:
        after, limit = steps_query(request.query)
        metrics = self.service.metrics
        records = [] if metrics is None else metrics.recent(after, limit)
        body = {"steps": [step_view(r) for r in records], "steps_done": self.service.steps_done,
                "limit": limit, "more": len(records) == limit}
        return web.Response(body=_dumps(body), content_type="application/json", headers=_JSON_HEADERS)


def steps_query(query: Any) -> tuple[int | None, int]:
    """(after, limit) from /v1/steps's query, or 400 naming what to change."""
    for name in query:
        if name not in ("after", "limit"):
            raise web.HTTPBadRequest(text=f"unknown query parameter {name[:40]!r}: /v1/steps takes after and limit")
        if len(query.getall(name)) > 1:
            raise web.HTTPBadRequest(text=f"{name} given more than once")
    after = limit = None
    if "after" in query:
        raw = query["after"]
        if not _COUNT.fullmatch(raw) or int(raw) > MAX_STEP:
            raise web.HTTPBadRequest(text=f"after must be a step number: an integer from 0 to {MAX_STEP}")
        after = int(raw)
    if "limit" in query:
        raw = query["limit"]
        if not _COUNT.fullmatch(raw) or not 1 <= int(raw) <= STEPS_LIMIT:
            raise web.HTTPBadRequest(text=f"limit must be an integer from 1 to {STEPS_LIMIT}")
        limit = int(raw)
    return after, STEPS_LIMIT if limit is None else limit


def step_view(record: dict[str, Any]) -> dict[str, Any]:
    """The numbers the page draws of one step record; staleness as its mean and max over the step's groups."""
    out = {k: _number(record.get(k)) for k in STEP_FIELDS if k in record}
    staleness = record.get("staleness")
    if isinstance(staleness, list) and staleness:
        out["staleness_mean"] = round(sum(staleness) / len(staleness), 4)
        out["staleness_max"] = max(staleness)
    return out


def peer_view(service: LearnerView) -> dict[str, Any]:
    """The peers the learner sees: its broadcast tracker's latest cards (at most overlay.max_cards),
    each with what the learner itself knows of it (measured µ, groups delivered, activation, ban)."""
    cards = list(service.broadcast.cards)
    capacity = service.activation.snapshot()
    planned = bool(capacity["planned"])
    standby = set(capacity["plan"].get("standby", ())) if planned else set()
    mu: dict[str, float] = capacity["delivered_mu"]
    intake = service.intake
    seen = set(intake.seen) if intake is not None else set()
    delivered = intake.delivered if intake is not None else {}
    bans = intake.ledger.bans if intake is not None else {}
    published = service.published.version if service.published is not None else None
    now_ms = time.time() * 1000

    def activation(peer: str, role: str) -> str | None:
        """What the learner lets this peer do now (the intake's gate, learner/activation_loop.py)."""
        if role != "rollout":
            return None
        if peer in bans:
            return "banned"
        if peer in standby:
            return "standby"  # the active set meets the floor more cheaply: no leases
        if peer not in seen:
            return "idle"  # never asked this learner for work
        return "active" if delivered.get(peer, 0) else "probation"  # probation: nothing delivered yet

    def behind(version: int | None, role: str) -> int | None:
        """Versions this follower lags the learner's published one, as of its last card."""
        if published is None or version is None or role == "learner":
            return None
        return max(0, published - version)

    rows = []
    for c in cards:
        ban = bans.get(c.peer_id)
        rows.append({
            "peer_id": c.peer_id, "role": c.role, "price": c.price, "state": c.state, "version": c.version,
            "behind": behind(c.version, c.role),
            "fetching": c.fetching, "rollouts_per_s": c.rollouts_per_s, "mu": mu.get(c.peer_id),
            "groups": delivered.get(c.peer_id, 0), "activation": activation(c.peer_id, c.role),
            "working_here": c.peer_id in seen, "reach": reach(c.chunk_url, c.maddrs), "chunk_url": c.chunk_url,
            "upload_bps": c.upload_bps, "software": c.software, "banned": ban.reason if ban else None,
            "arrival_s": max(c.arrivals, key=lambda a: a.version).seconds if c.arrivals else None,
            "last_seen_s": round(max(0.0, now_ms - c.updated_ms) / 1000, 1),
        })
    # The learner itself, then peers working here, then the rest, by role.
    rows.sort(key=lambda r: (_ROLE_ORDER[r["role"]] != 0, not r["working_here"], _ROLE_ORDER[r["role"]], r["peer_id"]))
    return {"peers": rows[:MAX_PEER_ROWS], "left_out": max(0, len(rows) - MAX_PEER_ROWS),
            "published_version": published, "planned": planned, "staleness": service.train.staleness}


def reach(chunk_url: str | None, maddrs: list[str]) -> str:
    """How the card says the peer can be reached (advertised, not probed by the learner)."""
    direct = [m for m in maddrs if "/p2p-circuit" not in m]
    p2p = "libp2p" if direct else "libp2p relay" if maddrs else None
    return " + ".join(x for x in ("http" if chunk_url else None, p2p) if x) or "none"


def content_security_policy(html: str) -> str:
    """Only the page's own inline script and style (by hash), requests to this server, no HTML sinks."""

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
            "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'; "
            "require-trusted-types-for 'script'; trusted-types 'none'")


def _number(value: Any) -> Any:
    """JSON has no NaN or infinity (a skipped step's loss may be one): those become null."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def _dumps(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
