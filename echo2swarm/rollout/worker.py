"""The rollout peer's work loop: lease prompts from the learner, generate, stream the groups back.

    learner = publisher of the trusted head ─► rpc_lease ─► [offer the lease's head to the follower]
        ─► wait until the engine holds ≥ min_version ─► engine's queue (runner.py) ─► rpc_submit

The stages overlap: the next lease is asked for while batches generate (`worker.prefetch_leases`),
a lease goes into the engine's own queue as soon as it arrives, so the engine starts the next
batch the moment one finishes, and finished batches are submitted while the next one generates
(`worker.max_pending_submits`). On a fast engine the round trips to the learner and the daemon's
own event loop cost no generation time. The engine runs in a process of its own by default
(`engine.isolate`, engines/host.py and host_process.py), so generation never shares the GIL with
the event loop.

Double-buffering: the follower fetches the next version while the engine keeps generating with
the one it holds; the swap (refit.py) queues the load behind the batches already in the engine,
so it lands between batches, never inside one, and each batch carries the version it ran on.
Back-pressure comes from the learner: when it has enough work in flight it answers `LeaseWait`
and the worker asks again after the delay it names; when its cost-aware plan keeps this peer on
standby it says so (`LeaseWait.standby`), and the card shows `active: false`. The throughput µ
the card advertises is kept by throughput.py.

An engine that fails (its process died, or none could be started) costs the lease it held, counted
as `engine_errors` and `leases_abandoned`; the next lease starts a new engine process. Consecutive
failures back off exponentially (`runtime.aio.backoff_s`), so an engine that dies on every batch (out
of memory, a broken driver) does not take a lease and restart in a tight loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

from echo2swarm.config.models import RolloutConfig
from echo2swarm.overlay.node import Overlay
from echo2swarm.overlay.rpc import RpcError, RpcStub
from echo2swarm.policy.follower import PolicyFollower
from echo2swarm.rollout.refit import EngineWeights
from echo2swarm.rollout.throughput import Throughput
from echo2swarm.runtime.aio import backoff_s, wait_any
from echo2swarm.runtime.logging import Recurring, get_logger
from echo2swarm.wire.surfaces import LEARNER_RPC
from echo2swarm.wire.work import (
    CompletionMsg,
    GroupSubmission,
    Lease,
    LeaseRequest,
    LeaseWait,
)

logger = get_logger(__name__)
T = TypeVar("T")
REPEAT_LOG_S = 60.0  # how often an error that keeps recurring is logged again, with its count


class RolloutWorker:
    """Takes leases from the learner the follower trusts, generates on `weights`' engine, submits.

    Built by the daemon's follower service, which makes the engine's weights and µ first, since
    the follower also needs to know which versions the engine still reads:

        throughput = Throughput(config, state_dir / "throughput.json")
        weights = EngineWeights(config, on_built=throughput.calibrate)
        follower = PolicyFollower(..., in_use=weights.in_use)
        worker = RolloutWorker(config, follower, weights, throughput, overlay, announce=announcer.trigger)
    """

    def __init__(self, config: RolloutConfig, follower: PolicyFollower, weights: EngineWeights,
                 throughput: Throughput, overlay: Overlay, announce: Callable[[], None] = lambda: None):
        self.config = config
        self.follower = follower
        self.overlay = overlay
        self.announce = announce  # our card changed: tell the swarm now
        self.weights = weights
        self.stats = weights.stats  # one set of counters: the lease loop's and the engine's (refits, errors)
        self.throughput = throughput
        self.active: bool | None = None  # False while the learner keeps us on standby
        self._last_error = ""
        self._rpc_warning = Recurring(logger, REPEAT_LOG_S)
        self._waited_s = 0.0  # the lease loop's LeaseWait sleeps, finished ones
        self._waiting_since: float | None = None  # start of the one under way
        self._idle_from: tuple[float, float] | None = None  # engine idle since, told-to-wait seconds then
        self._generating_from: float | None = None  # since when a batch has been in the engine
        self._in_engine = 0  # batches handed to the engine and not collected yet
        self._backoff_until = 0.0  # monotonic time before which no lease is asked for or dispatched
        self._engine_failures = 0  # consecutive batches the engine failed; reset by one that succeeds
        self._unseeded_warned: set[str] = set()  # lease samplers the engine lacks, warned about once each

    async def on_version(self, version: int, path: Path) -> None:
        """A newly installed version (the follower's callback): see `EngineWeights.on_version`."""
        await self.weights.on_version(version, path)

    def close(self) -> None:
        """Stop the engine (its process, or its thread once the batch under way ends)."""
        self.weights.close()

    def _set_active(self, active: bool) -> None:
        if active != self.active:
            self.active = active
            logger.info("the learner made this peer %s", "active" if active else "standby")
            self.announce()

    def _learner(self, learner: str) -> RpcStub:
        """The learner's surface (wire/surfaces.py) on `learner`: `.lease(request)`, `.submit(groups)`."""
        return RpcStub(self.overlay.p2p, self.config.overlay.swarm, LEARNER_RPC, learner)

    def _note_error(self, message: str) -> None:
        self.stats["rpc_errors"] += 1
        self._rpc_warning(message)  # once per distinct problem, then a line a minute while it goes on
        self._last_error = message

    # -- loop ----------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Three overlapping stages, so the engine never waits on a round trip it could hide:

            lease loop ─► queue ─► dispatch (version check) ─► engine's own queue ─► collect ─► submit tasks

        Up to `worker.prefetch_leases` + 1 leases are held at once, and each goes to the engine as
        soon as it arrives: the engine finds the next batch queued the moment one finishes, however
        busy the daemon's event loop is. The next lease is asked for while batches generate, and a
        finished batch is submitted while the next one generates. Seconds the engine sits empty are
        counted: `wait_s` when the learner had no work for us (its limit), `starved_s` otherwise.
        """
        cfg = self.config.worker
        queue: asyncio.Queue[tuple[str, Lease, float]] = asyncio.Queue()
        slots = asyncio.Semaphore(cfg.prefetch_leases + 1)  # leases held and not yet generated
        inflight: asyncio.Queue[tuple[str, Lease, asyncio.Future[Any]] | None] = asyncio.Queue()
        pending: set[asyncio.Task[None]] = set()
        self._idle_from = (time.perf_counter(), self._told_to_wait_s())
        leaser = asyncio.create_task(self._lease_loop(queue, slots, stop))
        collector = asyncio.create_task(self._collect(inflight, slots, pending, stop))
        try:
            while not stop.is_set():
                got = await _get(queue, stop)
                if got is None:
                    break
                learner, lease, received = got
                batch = await self._dispatch(lease, received, stop)
                if batch is None:
                    slots.release()
                    continue
                inflight.put_nowait((learner, lease, batch))
        finally:
            leaser.cancel()
            inflight.put_nowait(None)  # the collector finishes what the engine was given, then ends
            await asyncio.gather(leaser, return_exceptions=True)
            await asyncio.wait({collector}, timeout=cfg.rpc_timeout_s)
            collector.cancel()
            await asyncio.gather(collector, return_exceptions=True)
            if pending:  # groups already generated: give them their chance to land
                await asyncio.wait(pending, timeout=cfg.rpc_timeout_s)

    async def _lease_loop(self, queue: asyncio.Queue[tuple[str, Lease, float]], slots: asyncio.Semaphore,
                          stop: asyncio.Event) -> None:
        cfg = self.config.worker
        while not stop.is_set():
            if not self.weights.ready.is_set():  # a lease taken now would expire while the engine starts
                await wait_any(stop, self.weights.ready, timeout=cfg.idle_retry_s)
                continue
            backoff = self._backoff_until - time.monotonic()
            if backoff > 0:  # the engine or the learner's leases just failed: a lease taken now would too
                await _sleep(stop, backoff)
                continue
            await slots.acquire()
            # Only the learner whose signed head we trust gets our work; a card claiming to be a
            # learner is not enough (anyone can announce one).
            learner = self.follower.publisher
            if learner is None:
                slots.release()
                await _sleep(stop, cfg.idle_retry_s)
                continue
            started = time.perf_counter()
            try:
                reply = await self._learner(learner).lease(
                    # The newest version on disk, loaded or not: a lease that needs it loads it at once.
                    LeaseRequest(max_prompts=cfg.max_prompts, held_version=self.weights.runnable_version(),
                                 wait_s=cfg.lease_wait_s),
                    timeout=cfg.rpc_timeout_s,
                )
            except RpcError as e:
                slots.release()
                self._note_error(f"lease request failed: {e}")
                await _sleep(stop, cfg.idle_retry_s)
                continue
            took = time.perf_counter() - started
            self._waited_s += min(reply.held_s, took)  # held by the learner for lack of work: its limit
            self.stats["lease_rpc_s"] += took
            if reply.head:
                self.follower.offer(reply.head)
            if isinstance(reply, LeaseWait):
                slots.release()
                self.stats["waits"] += 1
                if reply.done and reply.reason != self._last_error:
                    # Training finished, or this learner banned us for the run: nothing to do but say so.
                    level = logger.error if reply.reason.startswith("banned") else logger.info
                    level("the learner gives no more work: %s", reply.reason)
                    self._last_error = reply.reason
                if reply.standby or self.active is not None:
                    self._set_active(not reply.standby)
                self._waiting_since = time.perf_counter()
                try:
                    await _sleep(stop, reply.retry_s)
                finally:
                    self._stop_waiting()
                continue
            self._set_active(True)
            self.stats["leases"] += 1
            queue.put_nowait((learner, reply, time.monotonic()))

    def _engine_took(self) -> None:
        """A batch went to the engine."""
        self._in_engine += 1
        if self._in_engine == 1:
            self.stats.update(self._idle_split())
            self._idle_from = None
            self._generating_from = time.perf_counter()

    def _engine_gave(self) -> None:
        """A batch came back from the engine (or failed there)."""
        self._in_engine -= 1
        if self._in_engine == 0:
            now = time.perf_counter()
            if self._generating_from is not None:
                self.stats["generate_s"] += now - self._generating_from
            self._generating_from = None
            self._idle_from = (now, self._told_to_wait_s())

    def _idle_split(self) -> dict[str, float]:
        """The engine's idle interval under way, split: learner had no work (`wait_s`) / anything else (`starved_s`)."""
        if self._idle_from is None:
            return {}
        since, told = self._idle_from
        idle = time.perf_counter() - since
        waited = min(idle, self._told_to_wait_s() - told)
        return {"wait_s": waited, "starved_s": idle - waited}

    def snapshot(self) -> dict[str, float]:
        """Counters as of now, the idle or generating interval under way included (exact windows for benchmarks).

        `generate_s` counts the seconds with a batch in the engine; the engine's own compute
        seconds are its `busy_s` (in the daemon's stats as `engine_busy_s`).
        """
        stats = Counter(self.stats)
        stats.update(self._idle_split())
        generating = self._generating_from
        if generating is not None:
            stats["generate_s"] += time.perf_counter() - generating
        return dict(stats)

    def _stop_waiting(self) -> None:
        if self._waiting_since is not None:
            self._waited_s += time.perf_counter() - self._waiting_since
            self._waiting_since = None

    def _told_to_wait_s(self) -> float:
        """Seconds the lease loop has spent waiting because the learner said so, the wait under way included."""
        since = self._waiting_since
        return self._waited_s + (time.perf_counter() - since if since is not None else 0.0)

    async def _dispatch(self, lease: Lease, received: float, stop: asyncio.Event) -> asyncio.Future[Any] | None:
        """Hand one lease to the engine's queue; None when it cannot or should no longer be served."""
        from echo2swarm.rollout.engines.base import SamplingParams
        from echo2swarm.rollout.engines.runner import EngineProcessError

        backoff = self._backoff_until - time.monotonic()
        if backoff > 0:  # the last lease could not be served at all: don't spin on the next ones
            await _sleep(stop, backoff)
        weights = self.weights
        newest = weights.newest[0] if weights.newest is not None else 0
        if (weights.version or 0) < lease.min_version:
            if newest < lease.min_version or weights.version is None:  # not installed, or the engine not built
                started = time.perf_counter()
                ok = await self.follower.wait_for(lease.min_version, timeout=lease.deadline_s / 2)
                self.stats["version_wait_s"] += time.perf_counter() - started
                if not ok:
                    self.stats["leases_abandoned"] += 1  # the learner re-issues it when it expires
                    logger.debug("lease %s abandoned: v%d not installed in time", lease.lease_id, lease.min_version)
                    return None
            await weights.refit()  # needed now, whatever the refit budget says
            if (weights.version or 0) < lease.min_version:
                self.stats["leases_abandoned"] += 1
                logger.debug("lease %s abandoned: needs v%d, the engine holds v%s (newest installed: %s)",
                             lease.lease_id, lease.min_version, weights.version, weights.newest)
                return None
        elif newest > (weights.version or 0) and (weights.version <= lease.min_version or weights.refit_due()):
            # A version deferred for the refit budget: loaded once the budget allows, or at once when
            # the engine holds the oldest version this lease accepts, so that rollouts generated for
            # it are not one learner step away from being too stale to train on.
            await weights.refit()
        if time.monotonic() - received > lease.deadline_s:  # held too long: the learner has re-issued it
            self.stats["leases_expired"] += 1
            return None
        spec = lease.sampling
        sampler = self._sampler_for(lease)
        params = SamplingParams(n=spec.n, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                                top_p=spec.top_p, seed=spec.seed, sampler=sampler,
                                prompt_ids=tuple(p.prompt_id for p in lease.prompts) if sampler else None)
        try:
            # In a thread: taking the lock waits out a swap's submission, and a dead engine process
            # is restarted right there (seconds), neither of which may stall the event loop.
            future = await asyncio.to_thread(weights.submit_batch, [p.text for p in lease.prompts], params)
        except EngineProcessError as e:  # no engine process could be started: counted, retried later
            self.stats["leases_abandoned"] += 1
            self._engine_failed(f"cannot start the engine: {e}")
            return None
        self._engine_took()
        return asyncio.wrap_future(future)

    def _sampler_for(self, lease: Lease) -> str | None:
        """The lease's seeded sampler when this peer's engine implements it, else None (its own generator:
        a learner that requires seeded sampling then refuses the groups as `unseeded`)."""
        from echo2swarm.rollout.engines.base import SEEDED_SAMPLERS

        sampler, engine = lease.sampling.sampler, self.weights.engine.name
        if sampler is None or sampler in SEEDED_SAMPLERS.get(engine, frozenset()):
            return sampler
        if sampler not in self._unseeded_warned:
            self._unseeded_warned.add(sampler)
            logger.warning("the %s engine does not implement the lease's sampler %r: sampling with its own "
                           "generator, and a learner that requires seeded sampling refuses these groups (unseeded)",
                           engine, sampler)
        return None

    def _backoff(self, message: str, seconds: float | None = None) -> None:
        self._backoff_until = time.monotonic() + (seconds if seconds is not None else self.config.worker.idle_retry_s)
        if message != self._last_error:  # once per distinct problem, not per lease
            logger.error("%s", message)
            self._last_error = message

    def _engine_failed(self, message: str) -> None:
        self.stats["engine_errors"] += 1
        if time.monotonic() < self._backoff_until:  # another batch lost to the failure that started this pause
            return
        self._engine_failures += 1
        delay = backoff_s(self._engine_failures, self.config.worker.idle_retry_s)
        self._backoff(f"{message}; {self._engine_failures} engine failure(s) in a row, next lease in {delay:.1f} s",
                      delay)

    async def _collect(self, inflight: asyncio.Queue[tuple[str, Lease, asyncio.Future[Any]] | None],
                       slots: asyncio.Semaphore, pending: set[asyncio.Task[None]], stop: asyncio.Event) -> None:
        """Take the engine's batches in order and submit each in a task of its own. A batch the engine
        loses because the daemon is stopping (`stop` set: it closes the engine) is said at INFO, not
        counted as an engine failure."""
        from echo2swarm.rollout.engines.runner import EngineProcessError, VersionMismatch

        submits = asyncio.Semaphore(self.config.worker.max_pending_submits)
        while (item := await inflight.get()) is not None:
            learner, lease, future = item
            try:
                batch = await future
            except VersionMismatch as e:  # its version's load failed: nothing generated is mislabelled
                self.stats["leases_abandoned"] += 1
                logger.warning("lease %s dropped: %s", lease.lease_id, e)
                continue
            except EngineProcessError as e:  # counted; the next lease starts a new engine process
                self.stats["leases_abandoned"] += 1
                if stop.is_set():
                    logger.info("lease %s dropped: the daemon is stopping (%s)", lease.lease_id, e)
                else:
                    self._engine_failed(f"generation failed: {e}")
                continue
            except ValueError as e:  # a lease this engine cannot serve (e.g. a prompt past max_model_len)
                self.stats["leases_abandoned"] += 1
                self._backoff(f"cannot generate for this learner's leases: {e}")
                continue
            finally:
                self._engine_gave()
                slots.release()
            self._engine_failures = 0
            groups = self._groups(lease, batch)
            await submits.acquire()  # back-pressure: at most max_pending_submits batches unsent
            task = asyncio.create_task(self._submit(learner, groups))
            pending.add(task)
            task.add_done_callback(lambda t: (pending.discard(t), submits.release()))

    async def _submit(self, learner: str, groups: list[GroupSubmission]) -> None:
        cfg = self.config.worker
        started = time.perf_counter()
        try:
            result = await self._learner(learner).submit(groups, timeout=cfg.rpc_timeout_s)
        except RpcError as e:
            self.stats["groups_unsent"] += len(groups)  # generated, never delivered: counted, not silent
            self._note_error(f"submit failed: {e}")
            return
        self.stats["submit_rpc_s"] += time.perf_counter() - started
        self.stats["groups_accepted"] += result.accepted
        for reason, n in result.refused.items():
            self.stats[f"refused_{reason}"] += n

    def _groups(self, lease: Lease, batch: Any) -> list[GroupSubmission]:
        """One lease's batch as submissions; updates µ (rollouts per engine second) and the counters."""
        spec = lease.sampling
        sampler = self._sampler_for(lease)
        rollouts = len(lease.prompts) * spec.n
        self.throughput.observe(spec.n, spec.max_new_tokens, rollouts, batch.busy_s)
        self.stats["rollouts"] += rollouts
        self.stats["batches"] += 1
        self.stats["tokens"] += sum(len(c.token_ids) for group in batch.groups for c in group)
        return [
            GroupSubmission(
                lease_id=lease.lease_id, prompt_id=prompt.prompt_id, version=batch.version,
                completions=[CompletionMsg(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason)
                             for c in completions],
                generation_s=batch.busy_s / len(lease.prompts), sampler=sampler,
            )
            for prompt, completions in zip(lease.prompts, batch.groups)
        ]


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    await wait_any(stop, timeout=seconds)


async def _get(queue: asyncio.Queue[T], stop: asyncio.Event) -> T | None:
    """The queue's next item, or None once `stop` is set."""
    if not queue.empty():
        return queue.get_nowait()
    getter = asyncio.ensure_future(queue.get())
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not getter.done():
            getter.cancel()
        await asyncio.gather(getter, stopper, return_exceptions=True)
    return getter.result() if getter.done() and not getter.cancelled() else None
