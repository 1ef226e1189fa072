"""Follow the learner: watch its signed head, fetch newer versions, install them.

    DHT heads (every head_poll_s), a head long-polled from the learner's chunk server (at once), or
    one offered by the learner's lease reply
      ─► TrustAnchor.select ─► verify_head ─► PolicyFetcher (manifest, plan, chunks) ─► VersionStore
                                                   │                            └─► on_version(v, dir)
                                                   └─► InFlight: each verified chunk is re-served at once

Each chunk's route comes from the learner's signed broadcast plan (policy/broadcast_plan.py) and the
peer cards: plan parent first (held open until it has the chunk), then peers holding the whole
version, then the learner; one the plan leaves out asks its foster parents first (`BroadcastPlan.fosters`).
A follower reads only the cards of its upstream peers (its parents and theirs) or fosters, by their own
DHT keys (a few lookups whatever the swarm's size); without a plan, the swarm's cards. They are re-read
while a fetch runs, so holders that finish meanwhile take load off the learner.

An offered head goes through exactly the same checks as one read from the DHT; it only saves
the poll interval, which matters when the learner publishes every fraction of a second. Once a
trusted head has named the learner's chunk URL, `_long_poll` keeps one request open there
(`GET /v1/head?after=<newest seen>&wait=<fetch.head_wait_s>`): the learner answers it when it
publishes, so a new version is seen within milliseconds rather than half a DHT poll later. Its
answer is bounded (MAX_HEAD_BYTES) and only offered; an answer that is not newer and came early (a
server that does not hold it, or a hostile one) is followed by a pause of head_poll_s, so a
follower asks at most once per head_poll_s or per held answer. A step with an offered head does not
read the DHT first (the next idle step does, every head_poll_s as before; while heads keep being
offered, at least every DHT_OVERDUE x head_poll_s).

Manifest and broadcast plan are fetched at the same time, then the upstream peers' cards (waited for
only while a plan parent's card is unknown). `path_of[v]["spans"]` keeps where a version's time went,
in seconds: manifest (with plan and cards), path (walking back hash links), chunks, check (rebuild or
dense check), commit.

It runs as one task beside the daemon's other work, so whatever the peer does with the version
it holds (generation, serving chunks) goes on while the next version downloads. Every refused head is
counted by reason in `refused` and logged, once per distinct (reason, version, signer): a peer
re-announcing the same bad head every period can neither flood the log nor inflate the counts. A
head whose version was refused before (its weights matched no path) is skipped, not fetched again,
and counted in `refused["known_bad"]` once per distinct signed head record (the learner re-signs
its head at each announcement; a replayed record counts once); at most MAX_SKIP_RECORDS are remembered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

import aiohttp

from echo2swarm.config.models import FetchConfig, StoreConfig
from echo2swarm.overlay.node import Overlay
from echo2swarm.wire.records import PeerCard
from echo2swarm.policy.catchup import Linked
from echo2swarm.policy.installer import Links, VersionInstaller
from echo2swarm.policy.broadcast_plan import MAX_PLAN_BYTES, BroadcastPlan, PlanError, verify_plan
from echo2swarm.policy.fetcher import FetchError, PolicyFetcher, busy_pause_s
from echo2swarm.policy.sources import ChunkSource, HttpSource, PeerSource, SourceBusy, SourceError
from echo2swarm.policy.manifest import ChunkRef, ManifestError, verify_head
from echo2swarm.wire.records import HeadRecord, parse_head
from echo2swarm.wire.signing import PublicKey
from echo2swarm.policy.p2p import P2PSource
from echo2swarm.policy.peer_auth import PeerSigner, SignedSession
from echo2swarm.policy.pipeline import InFlight
from echo2swarm.policy.store import ChunkStore, VersionStore, collect_garbage
from echo2swarm.policy.trust import TrustAnchor
from echo2swarm.runtime.aio import backoff_s, wait_any
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
OnVersion = Callable[[int, Path], Awaitable[None]]
MAX_HEAD_BYTES = 16 * 1024  # a long-polled head's body at most (a head record is under 2 KiB)
DHT_OVERDUE = 4  # with heads offered (long-poll, lease replies), the DHT is still read every 4 x head_poll_s
MAX_SKIP_RECORDS = 1024  # distinct skipped head records remembered (for counting `known_bad` once each)
PARENT_MAX_LAG = 3  # a plan parent whose card is further behind than this is not waited for (cards lag ~2 s)
PLAN_UPSTREAM_DEPTH = 3  # cards read a chain: our parent, its parent and theirs (those hold a version before us)


def next_refresh_wait(wait: float, refresh_s: float, ttl_s: float, sampling: bool) -> float:
    """Seconds until a fetch's next read of the cards, `wait` having been the last. A follower no plan
    places in a sharded swarm (over ~128 peers) reads a sample of the card shards, and each read finds
    fewer holders it did not know: it waits twice as long each time, up to one record TTL (these reads
    were most of every node's DHT traffic at 10,000 peers: docs/benchmarks.md, "Simulated swarms").

    >>> [next_refresh_wait(w, 2.0, 30.0, True) for w in (2.0, 16.0, 30.0)], next_refresh_wait(8.0, 2.0, 30.0, False)
    ([4.0, 30.0, 30.0], 2.0)
    """
    return min(2 * wait, max(wait, ttl_s)) if sampling else refresh_s


class PolicyFollower:
    def __init__(
        self,
        overlay: Overlay,
        fetch: FetchConfig,
        store: StoreConfig,
        trust: TrustAnchor,
        chunks: ChunkStore,
        versions: VersionStore,
        session: aiohttp.ClientSession,
        on_version: OnVersion | None = None,
        on_state: Callable[[], None] = lambda: None,
        inflight: InFlight | None = None,
        in_use: Callable[[], Collection[int]] = lambda: (),
    ):
        self.overlay = overlay
        self.swarm = overlay.config.swarm
        self.fetch_config = fetch
        self.store_config = store
        self.trust = trust
        self.chunks = chunks
        self.versions = versions
        self.session = session
        # Our HTTP requests to peers carry a credential of our peer id (policy/peer_auth.py): a peer seen
        # working by the server may take its reserves of held requests and connections.
        self.signer = PeerSigner(overlay.key)
        self.on_version = on_version
        self.on_state = on_state  # the card changed (fetch began or ended): announce it now
        # Versions whose files a reader still needs (the rollout engine's: see EngineWeights.in_use);
        # garbage collection keeps them whatever their age.
        self.in_use = in_use
        self.inflight = inflight or InFlight()
        self.inflight.poke = self.poke
        self.fetcher = PolicyFetcher(fetch, chunks, served=lambda peer: overlay.saw_work(peer, "served"))
        # Sources that stalled, were too slow or lied, and until when: kept across versions (fetcher.py).
        self.bans = self.fetcher.bans
        self.held_version: int | None = versions.latest()
        self.ready_version: int | None = None  # installed and handed to on_version
        self.fetching_version: int | None = None
        self.refused: Counter[str] = Counter()
        self.arrival_s: dict[int, float] = {}
        self._first_seen: dict[int, float] = {}
        self._cards: list[PeerCard] = []
        self._parent_noted: tuple[str, str, int] | None = None  # (why, parent, version) last counted as `parent_<why>`
        self._sources: dict[str, ChunkSource] = {}
        self._publisher_cache: tuple[tuple[str, str | None, tuple[str, ...]], ChunkSource] | None = None
        self.plan: BroadcastPlan | None = None
        self._logged: set[tuple[str, int, str]] = set()
        self._offered: HeadRecord | None = None
        self._last_dht_poll = float("-inf")
        self._cards_at = float("-inf")  # when the peer cards were last read
        self._head_url: str | None = None  # the learner's chunk URL, from its newest trusted head: long-polled
        self._seen_version = 0  # newest version of a trusted, verified head (what a long-poll asks past)
        self._skipped: set[tuple[int, int, str]] = set()
        # Peer id of the learner whose trusted head we follow: the only learner a rollout peer works for.
        self.publisher: str | None = None
        self.verifiers: frozenset[str] = frozenset()  # the verifier daemons that learner's head lists
        self._wake = asyncio.Event()
        self._installed = asyncio.Condition()
        # Delta versions: paths chosen, hops fetched, rebuilt and checked (policy/installer.py).
        self.installer = VersionInstaller(self.fetcher, chunks, versions, self.inflight, self.refused, Links(
            holders=self._holders, route=self._route, trusted=self._trusted, swarm=self.swarm,
            peer_assist=fetch.peer_assist))
        # how each installed version was reached (policy/catchup.PATHS) and what it cost: the installer's
        self.paths = self.installer.paths
        self.path_of = self.installer.path_of  # version -> {"path", "bytes", "hops"}, last 16

    def offer(self, head_json: str) -> None:
        """A head seen outside the DHT (a lease reply): fetch it now if it is newer. Verified like any other."""
        try:
            head = parse_head(json.loads(head_json))
        except ValueError:  # RecordError included
            self.refused["malformed"] += 1
            return
        if self.held_version is None or head.version > self.held_version:
            if self._offered is None or head.version > self._offered.version:
                self._offered = head
            self._wake.set()

    def poke(self) -> None:
        """Someone asked us for a version newer than ours: look at the DHT now, not at the next poll."""
        self._last_dht_poll = float("-inf")
        self._wake.set()

    async def wait_for(self, version: int, timeout: float) -> bool:
        """Wait until a version >= `version` is installed; False on timeout."""
        async with self._installed:
            try:
                await asyncio.wait_for(
                    self._installed.wait_for(lambda: (self.ready_version or 0) >= version), timeout
                )
            except asyncio.TimeoutError:
                return False
        return True

    @property
    def state(self) -> str:
        return "syncing" if self.fetching_version is not None or self.held_version is None else "ready"

    def _refuse(self, error: ManifestError, head: HeadRecord) -> None:
        tag = (error.reason, head.version, head.public_key)
        if tag not in self._logged:
            self._logged.add(tag)
            self.refused[error.reason] += 1
            logger.warning("refused policy head v%d (%s): %s", head.version, error.reason, error)

    async def run(self, stop: asyncio.Event) -> None:
        poller = asyncio.create_task(self._long_poll(stop))
        try:
            await self._run(stop)
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)

    async def _long_poll(self, stop: asyncio.Event) -> None:
        """Keep one long-poll of the learner's head open; offer what it answers (verified in `step`)."""
        config = self.fetch_config
        while not stop.is_set():
            url, wait = self._head_url, config.head_wait_s
            if url is None or wait <= 0:
                await wait_any(stop, timeout=config.head_poll_s)
                continue
            after = max(self.held_version or 0, self._seen_version)
            started = time.monotonic()
            data = await self._get_head(url, after, wait)
            newer = data is not None and self._take_polled(data, after)
            # Held and answered (a new head, or the wait ran out): ask again at once. Answered early
            # with nothing newer and verified (no long-poll there, an error, a forgery): at the DHT's pace.
            if not newer and time.monotonic() - started < wait / 2:
                await wait_any(stop, timeout=config.head_poll_s)

    def _take_polled(self, data: str, after: int) -> bool:
        """Offer a long-polled head if it is newer than `after` and verifies (signature, swarm, pinned
        key); count it refused otherwise. True: offered."""
        try:
            head = parse_head(json.loads(data))
        except ValueError:  # RecordError included
            self.refused["malformed"] += 1
            return False
        if head.version <= after or self.trust.key is None:
            return False
        try:
            verify_head(head, trusted=self.trust.key, swarm=self.swarm, held_version=self.held_version)
        except ManifestError as e:
            if e.reason != "stale_version":
                self._refuse(e, head)
            return False
        if self._offered is None or head.version > self._offered.version:
            self._offered = head
        self._seen_version = max(self._seen_version, head.version)
        self._wake.set()
        return True

    async def _get_head(self, url: str, after: int, wait: float) -> str | None:
        timeout = aiohttp.ClientTimeout(total=wait + self.fetch_config.manifest_timeout_s,
                                        sock_connect=self.fetch_config.manifest_timeout_s)
        try:
            async with self.session.get(f"{url}/v1/head", params={"after": str(after), "wait": f"{wait:g}"},
                                        headers=self.signer.headers(self.publisher, "/v1/head"),
                                        timeout=timeout) as resp:
                if resp.status != 200 or (resp.content_length or 0) > MAX_HEAD_BYTES:
                    return None
                body = b""
                while len(body) <= MAX_HEAD_BYTES and (piece := await resp.content.read(MAX_HEAD_BYTES + 1 - len(body))):
                    body += piece
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            logger.debug("head long-poll of %s failed: %s", url, e)
            return None
        if len(body) > MAX_HEAD_BYTES:
            return None
        try:
            return body.decode()
        except UnicodeDecodeError:
            self.refused["malformed"] += 1
            return None

    async def _run(self, stop: asyncio.Event) -> None:
        failures = 0
        while not stop.is_set():
            try:
                await self.step()
                failures = 0
            except (FetchError, ManifestError) as e:
                failures += 1
                logger.warning("version fetch failed (attempt %d): %s", failures, e)
            except Exception:
                failures += 1
                logger.exception("policy follower step failed")
            delay = self.fetch_config.head_poll_s
            if failures:
                delay = max(delay, backoff_s(failures, self.fetch_config.retry_backoff_s))
            elif self._offered is not None:
                continue
            self._wake.clear()
            await wait_any(stop, self._wake, timeout=delay)

    async def step(self) -> int | None:
        """Look once; fetch and install a newer version if one is announced. Returns the version installed."""
        heads: list[HeadRecord] = []
        if self._offered is not None:
            heads, self._offered = [self._offered], None
        # With an offered head the DHT read waits for the next idle step (the version's fetch goes
        # first), unless it is DHT_OVERDUE x head_poll_s old: heads from other keys are still seen (and
        # refused) and a restarted learner is found while heads keep being offered.
        if not heads or time.monotonic() - self._last_dht_poll >= DHT_OVERDUE * self.fetch_config.head_poll_s:
            self._last_dht_poll = time.monotonic()
            heads += (await self.overlay.get_heads())[0]
        head = self.trust.select(heads, self.swarm)
        if head is not None:
            self.publisher = head.publisher
            self.verifiers = frozenset(head.verifiers)
            self.overlay.set_card_shards(head.card_shard_bits)  # where cards are stored and read (signed by the learner)
        if self.trust.key is not None:
            for other in heads:
                if other.public_key != self.trust.key.text:
                    self._refuse(ManifestError("untrusted_key", f"head signed by {other.public_key[8:24]}..., "
                                               "not the pinned learner key"), other)
        if head is None:
            return None
        try:
            verify_head(head, trusted=self.trust.key, swarm=self.swarm, held_version=self.held_version)
        except ManifestError as e:
            if not (e.reason == "stale_version" and head.version == self.held_version):
                self._refuse(e, head)
            return None
        assert self.trust.key is not None
        self._seen_version = max(self._seen_version, head.version)
        self._first_seen.setdefault(head.version, time.monotonic())
        if self.installer.refused_before(head.version, head.manifest_sha256):
            # refused once (its rebuilt weights did not match its own signed hashes): not fetched again
            record = (head.version, head.published_ms, head.signature[:32])
            if record not in self._skipped:
                if len(self._skipped) >= MAX_SKIP_RECORDS:
                    self._skipped.clear()
                self._skipped.add(record)
                self.refused["known_bad"] += 1
            return None
        started = time.perf_counter()
        publisher = self._publisher_source(head)
        if publisher is None:  # no address in the head and no card yet: read the cards first
            await self._refresh_cards()
            publisher = self._publisher_source(head)
        if publisher is None:
            raise FetchError(f"v{head.version}: the learner {head.publisher[-8:]} has no reachable card yet")
        self._head_url = head.chunk_url or getattr(publisher, "url", None)
        self.fetching_version = head.version
        self.on_state()
        refresher: asyncio.Task[None] | None = None
        try:
            # Manifest and plan at once, then the cards of the plan's upstream peers, by their own keys
            # (without a plan, the swarm's cards when they are stale); they are re-read while the
            # chunks come (the routes read `_cards` as they are when each chunk is asked for).
            fetched, plan = await asyncio.gather(
                self.fetcher.fetch_manifest(head, self._manifest_sources(head, publisher), trusted=self.trust.key,
                                            swarm=self.swarm, publisher=publisher.name),
                self._fetch_plan(head, publisher), return_exceptions=True)
            if isinstance(plan, BaseException):
                raise plan
            if isinstance(fetched, ManifestError):
                self._refuse(fetched, head)
                return None
            if isinstance(fetched, BaseException):
                raise fetched
            manifest, envelope = fetched
            self.plan = plan
            cards_read = asyncio.Event()
            refresher = asyncio.create_task(self._refresh_while_fetching(
                first=self._upstream() is not None or time.monotonic() - self._cards_at >= self.fetch_config.holders_refresh_s,
                read=cards_read))
            await self._await_parents(plan, cards_read)
            spans: Counter[str] = Counter(manifest=time.perf_counter() - started)
            path = await self.installer.catch_up(head, publisher, Linked(manifest, envelope), spans)
            if path is None:
                self.on_state()
                return None
        except BaseException:
            self.on_state()  # the card must stop advertising a fetch that is over
            raise
        finally:
            if refresher is not None:
                refresher.cancel()
            self.fetching_version = None
        self.held_version = manifest.version
        self.arrival_s[manifest.version] = time.monotonic() - self._first_seen.pop(manifest.version)
        self._first_seen = {v: t for v, t in self._first_seen.items() if v > manifest.version}
        for old in [v for v in self.arrival_s if v < manifest.version - 16]:
            del self.arrival_s[old]
        logger.debug(
            "installed policy v%d (%s path: %s bytes fetched, dense weights %d bytes; last hop from %s) in %.2f s at %s",
            manifest.version, self.last_path, self.path_of[manifest.version]["bytes"], manifest.dense_bytes,
            ", ".join(f"{k} {v >> 10} KiB" for k, v in self.fetcher.bytes_from.most_common()),
            self.arrival_s[manifest.version], path,
        )
        # The keyframe stays too: with it, a composite delta catches this peer up after a gap.
        keyframe = {manifest.keyframe.version} if manifest.keyframe is not None else set()
        await asyncio.to_thread(collect_garbage, self.versions, self.chunks, self.store_config.keep_versions,
                                set(self.in_use()) | keyframe)
        try:
            if self.on_version is not None:
                await self.on_version(manifest.version, path)
        finally:  # waiters see the version only once whoever uses it (the engine) has it
            self.ready_version = manifest.version
            async with self._installed:
                self._installed.notify_all()
            self.on_state()
        return manifest.version

    @property
    def last_path(self) -> str | None:
        return self.installer.last_path

    def _trusted(self) -> PublicKey:
        assert self.trust.key is not None  # heads are only acted on once a key is pinned
        return self.trust.key

    # -- sources ---------------------------------------------------------------------------------
    def _upstream(self) -> list[str] | None:
        """The peers before us in the plan of the version being fetched (PLAN_UPSTREAM_DEPTH a chain), or
        our foster parents in it when it leaves us out; None without such a plan."""
        plan, me = self.plan, self.overlay.peer_id
        if not self.fetch_config.upstream_cards or plan is None or plan.version != self.fetching_version:
            return None
        if not plan.places(me):
            return plan.fosters(me) or None
        return plan.upstream(me, PLAN_UPSTREAM_DEPTH)

    def _parents(self) -> set[str]:
        """The peers the plan of the version being fetched has us fetch from: our parents in every stripe
        (the publisher left out), or our foster parents."""
        plan = self.plan
        if plan is None or plan.version != self.fetching_version:
            return set()
        me = self.overlay.peer_id
        return ({plan.parent(me, i) for i in range(plan.stripe_count)} | set(plan.fosters(me))) - {None, plan.publisher}

    def _fosters(self) -> list[str]:
        """Our foster parents in the plan of the version being fetched (`BroadcastPlan.fosters`): planned
        peers we ask before holders and the learner when the plan leaves us out."""
        plan = self.plan
        if plan is None or plan.version != self.fetching_version:
            return []
        return plan.fosters(self.overlay.peer_id)

    async def _refresh_cards(self) -> None:
        """With a plan that places us: the cards of our upstream peers and the learner, by their own keys,
        a few lookups whatever the swarm's size. Without (no plan, or not in it: a late joiner): the
        learner's card and a sample of the swarm's, our own card shard and one other in turn, each
        bounded by overlay.max_cards (overlay/cards.py)."""
        upstream = self._upstream()
        if upstream is not None:
            cards, _ = await self.overlay.get_named_cards([*upstream, *([self.publisher] if self.publisher else [])])
            found = {c.peer_id for c in cards}
            missing = [p for p in self._parents() if p not in found and p not in self._sources]
            if missing:
                # A card stored while its peer's DHT routing was young can sit on nodes a lookup of its own key
                # does not reach for a while (16 relays started at once: a parent unknown for whole versions,
                # each of its chunks from the learner); the card shards hold it too.
                self.fetcher.stats["parent_card_fallback"] += 1
                more, _ = await self.overlay.get_cards(prefer=missing, whole=False)
                cards += [c for c in more if c.peer_id in missing]
        else:
            cards, _ = await self.overlay.get_cards(prefer=[self.publisher] if self.publisher else (), whole=False)
        self._cards = [c for c in cards if c.peer_id != self.overlay.peer_id and c.state != "stopping"]
        self._cards_at = time.monotonic()

    async def _refresh_while_fetching(self, first: bool = False, read: asyncio.Event | None = None) -> None:
        """Re-read the peer cards every holders_refresh_s while a fetch runs (`first`: at once too; a sample of
        a sharded swarm's cards at twice the interval each time, up to overlay.record_ttl_s). `read`
        is set once the cards are fresh (at once without `first`, else after the first read, failed or not)."""
        if read is not None and not first:
            read.set()
        wait = self.fetch_config.holders_refresh_s
        while True:
            if not first:
                await asyncio.sleep(wait)
            try:
                await self._refresh_cards()
            except Exception as e:  # a DHT hiccup must not abort the fetch
                logger.debug("card refresh failed: %s", e)
            first = False
            if read is not None:
                read.set()
            # Not placed (a sample of the card shards, or our fosters' cards: their addresses, once read, are kept
            # in `_sources`): fewer reads as the fetch goes on.
            plan = self.plan
            placed = plan is not None and plan.version == self.fetching_version and plan.places(self.overlay.peer_id)
            sampling = not (placed and self.fetch_config.upstream_cards) and self.overlay.cards.depth.bits > 0
            wait = next_refresh_wait(wait, self.fetch_config.holders_refresh_s, self.overlay.config.record_ttl_s,
                                     sampling)

    async def _await_parents(self, plan: BroadcastPlan | None, cards_read: asyncio.Event) -> None:
        """When the plan names a parent of ours whose card we have not read yet, wait (at most
        fetch.manifest_timeout_s) for the card read that runs beside the manifest: a chunk routed without
        its parent goes to the learner, one more upload on the swarm's scarcest uplink."""
        if plan is None or cards_read.is_set():
            return
        known = {c.peer_id for c in self._cards} | set(self._sources)
        if self._parents() <= known:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(cards_read.wait(), self.fetch_config.manifest_timeout_s)

    def _source_for(self, peer_id: str) -> ChunkSource | None:
        card = next((c for c in self._cards if c.peer_id == peer_id), None)
        if card is None:
            return self._sources.get(peer_id)
        source = self._sources.get(peer_id)
        if source is None or getattr(source, "url", None) != card.chunk_url:  # new peer, or it moved
            name = f"{card.role}:{peer_id[-8:]}"
            http = HttpSource(SignedSession(self.session, self.signer, peer_id), card.chunk_url,  # type: ignore[arg-type]
                              self.fetch_config, name=name, peer_id=peer_id) if card.chunk_url else None
            p2p = P2PSource(self.overlay, peer_id, list(card.maddrs), self.fetch_config, name=name)
            source = self._sources[peer_id] = PeerSource(http, p2p, name, peer_id, url=card.chunk_url,
                                                         config=self.fetch_config)
        return source

    def _publisher_source(self, head: HeadRecord) -> ChunkSource | None:
        """The learner's source: from the addresses in its head (signed by the trusted policy key) when
        it has them, else from its card (which only the learner's libp2p key can sign)."""
        if head.chunk_url is None and not head.maddrs:
            return self._source_for(head.publisher)
        address = (head.publisher, head.chunk_url, tuple(head.maddrs))
        cached = self._publisher_cache
        if cached is None or cached[0] != address:
            name = f"learner:{head.publisher[-8:]}"
            http = HttpSource(SignedSession(self.session, self.signer, head.publisher),  # type: ignore[arg-type]
                              head.chunk_url, self.fetch_config, name=name, peer_id=head.publisher) \
                if head.chunk_url else None
            p2p = P2PSource(self.overlay, head.publisher, list(head.maddrs), self.fetch_config, name=name)
            cached = self._publisher_cache = (address, PeerSource(http, p2p, name, head.publisher, url=head.chunk_url,
                                                                  config=self.fetch_config))
        return cached[1]

    def _parent_behind(self, peer_id: str, version: int) -> bool:
        """The card of plan parent `peer_id` shows it more than PARENT_MAX_LAG versions before `version`
        and not fetching it (counted once a version fetch as `parent_behind`)."""
        card = next((c for c in self._cards if c.peer_id == peer_id), None)
        if card is None or card.fetching == version or (card.version or 0) >= version - PARENT_MAX_LAG:
            return False
        return self._note_parent("behind", peer_id, version)

    def _parent_past(self, peer_id: str, version: int) -> bool:
        """The card of plan parent `peer_id` shows it on a newer version than `version`, neither holding
        nor fetching this one: it will never have it (a follower catching up after it fell behind, e.g.
        while the learner restarted). Counted once a version fetch as `parent_past`."""
        card = next((c for c in self._cards if c.peer_id == peer_id), None)
        if card is None or card.version is None or card.version <= version or card.fetching == version \
                or version in card.held:
            return False
        return self._note_parent("past", peer_id, version)

    def _note_parent(self, why: str, peer_id: str, version: int) -> bool:
        if self._parent_noted != (why, peer_id, version):
            self._parent_noted = (why, peer_id, version)
            self.fetcher.stats[f"parent_{why}"] += 1
        return True

    def _holders(self, version: int) -> list[ChunkSource]:
        out = []
        for card in self._cards:
            if version in card.held or card.version == version:
                source = self._source_for(card.peer_id)
                if source is not None:
                    out.append(source)
        return out

    def _manifest_sources(self, head: HeadRecord, publisher: ChunkSource) -> list[ChunkSource]:
        if not self.fetch_config.peer_assist:
            return [publisher]
        return [s for s in self._holders(head.version) if s.peer_id != head.publisher] + [publisher]

    async def _fetch_plan(self, head: HeadRecord, publisher: ChunkSource) -> BroadcastPlan | None:
        if not self.fetch_config.peer_assist:
            return None
        assert self.trust.key is not None
        deadline, rounds = time.monotonic() + self.fetch_config.manifest_timeout_s, 0
        try:
            while True:
                try:
                    data = await publisher.plan(head.version, MAX_PLAN_BYTES)
                    break
                except SourceBusy:  # the learner's control slots are full (a herd): ask again shortly
                    rounds += 1
                    if time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(busy_pause_s(rounds))
            plan = verify_plan(data, trusted=self.trust.key, swarm=self.swarm, version=head.version, publisher=head.publisher)
        except SourceError as e:
            logger.debug("no broadcast plan for v%d (%s): fetching from holders", head.version, e)
            return None
        except PlanError as e:
            self.refused["bad_plan"] += 1
            logger.warning("broadcast plan for v%d refused: %s", head.version, e)
            return None
        return plan

    def _route(self, head: HeadRecord, publisher: ChunkSource, index: int, ref: ChunkRef, version: int | None = None,
               planned: bool = True) -> list[tuple[ChunkSource, float]]:
        """Where to get chunk `index` of `version` (default: the head's): plan parent, or our foster parents
        when the plan leaves us out (either may wait for it; only on the head version's hops, whatever
        their path), holders (rotated), learner last."""
        if not self.fetch_config.peer_assist:
            return [(publisher, 0.0)]
        version = head.version if version is None else version
        route: list[tuple[ChunkSource, float]] = []
        parent = self.plan.parent(self.overlay.peer_id, index) if self.plan is not None and planned else None
        parents: list[str] = []
        if parent == head.publisher:
            route.append((publisher, 0.0))
        elif parent is not None:
            parents = [parent]
        elif planned and (fosters := self._fosters()):  # left out of the plan: foster parents, in turn by chunk
            k = index % len(fosters)
            parents = fosters[k:] + fosters[:k]
        for parent in parents:
            if (source := self._source_for(parent)) is not None:
                # a parent whose card shows it far behind is catching up itself (it may skip this version),
                # one already past this version will never fetch it: asked first, but not waited for
                idle = self._parent_behind(parent, version) or self._parent_past(parent, version)
                wait = 0.0 if idle else self.fetch_config.source_wait_s
                route.append((source, wait))
            else:  # its card not read yet (or expired): this chunk goes around its parent
                self.fetcher.stats["parent_unknown"] += 1
        holders = [s for s in self._holders(version) if s.peer_id != head.publisher]
        if holders:
            k = index % len(holders)
            route += [(s, 0.0) for s in holders[k:] + holders[:k]]
        route.append((publisher, 0.0))
        unique: dict[str, tuple[ChunkSource, float]] = {}
        for source, wait in route:
            unique.setdefault(source.name, (source, wait))
        return list(unique.values())
