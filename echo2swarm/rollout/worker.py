"""The rollout peer's work loop: lease prompts from the learner, generate, stream the groups back.

    learner = publisher of the trusted head ─► rpc_lease ─► [offer the lease's head to the follower]
        ─► wait until the engine holds ≥ min_version ─► engine's queue (runner.py) ─► rpc_submit

The stages overlap: the next lease is asked for while batches generate (`worker.prefetch_leases`),
a lease goes into the engine's own queue as soon as it arrives, so the engine starts the next
batch the moment one finishes, and finished batches are submitted while the next one generates
(`worker.max_pending_submits`). On a fast engine the round trips to the learner and the daemon's
own event loop cost no generation time. The engine runs in a process of its own by default
(`engine.isolate`, engines/host.py), so generation never shares the GIL with the event loop.

Double-buffering: the follower fetches the next version while the engine keeps generating with
the one it holds; the swap (`on_version`) queues the load behind the batches already in the
engine, so it lands between batches, never inside one, and each batch carries the version it
ran on. Back-pressure comes from the learner: when it has enough work in flight it answers
`LeaseWait` and the worker asks again after the delay it names; when its cost-aware plan keeps
this peer on standby it says so (`LeaseWait.standby`), and the card shows `active: false`.

Throughput µ: measured once when the engine loads (a short calibration batch, cached in the state
dir per engine, device, model, threads, pace and sampling settings, so a restart skips it), then an
EWMA over real leases, each timed by the engine itself; advertised in the card as
`rollouts_per_s` for the learner's planner.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, TypeVar

from echo2swarm.config.models import RolloutConfig
from echo2swarm.learner.protocol import (
    CompletionMsg,
    GroupSubmission,
    Lease,
    LeaseRequest,
    LeaseWait,
    SubmitResult,
)
from echo2swarm.overlay.rpc import RpcError, call_client_stream, call_unary, rpc_name
from echo2swarm.policy.follower import PolicyFollower
from echo2swarm.runtime.daemon import DaemonContext
from echo2swarm.runtime.aio import wait_any
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
T = TypeVar("T")


class RolloutWorker:
    def __init__(self, ctx: DaemonContext, follower: PolicyFollower):
        self.ctx = ctx
        self.config: RolloutConfig = ctx.config
        self.follower = follower
        self.engine: Any = None
        self.engine_version: int | None = None
        self.swap_s: float | None = None  # last on_version call, first engine build included
        self.refit_s: float | None = None  # last in-place weight reload, as the engine timed it
        self._lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        self.rollouts_per_s: float | None = None  # calibration, then EWMA of measured throughput
        self.active: bool | None = None  # False while the learner keeps us on standby
        self.sampling: tuple[int, int] | None = None  # (group size, max new tokens) of the last lease
        self._model_fp = ""
        self._cache_path = Path(self.config.state_dir) / "throughput.json"
        self._leases_since_save = 0
        self._last_error = ""
        self._waited_s = 0.0  # the lease loop's LeaseWait sleeps, finished ones
        self._waiting_since: float | None = None  # start of the one under way
        self._idle_from: tuple[float, float] | None = None  # engine idle since, told-to-wait seconds then
        self._generating_from: float | None = None  # since when a batch has been in the engine
        self._in_engine = 0  # batches handed to the engine and not collected yet
        self._newest: tuple[int, Path] | None = None  # the newest installed version, loaded or not
        self._last_refit_at: float | None = None  # monotonic time the last load was queued
        self._refit_lock = asyncio.Lock()
        self._refits: set[asyncio.Task[None]] = set()
        self._closing = False
        self._engine_ready = asyncio.Event()  # set once the first version is in a built engine
        self._backoff_until = 0.0  # monotonic time before which no lease is dispatched

    # -- weights ------------------------------------------------------------------------------
    async def on_version(self, version: int, path: Path) -> None:
        """A newly installed version: the first builds the engine; later ones are loaded in place at
        once, or, while loads would take more than `worker.max_refit_share` of the engine's time,
        when that budget allows or a lease needs them (only the newest waiting one is loaded)."""
        self._newest = (version, path)
        if self.engine is None:
            await asyncio.to_thread(self._build_engine, version, path)
            self._engine_ready.set()
        elif self._refit_due():
            await self._refit()
        else:
            self.stats["refits_deferred"] += 1

    def _runnable_version(self) -> int | None:
        """The newest version this peer can generate with without fetching: loaded, or installed and deferred."""
        newest = self._newest[0] if self._newest is not None else None
        if newest is None or self.engine_version is None:
            return self.engine_version
        return max(newest, self.engine_version)

    def _refit_due(self) -> bool:
        if self.refit_s is None or self._last_refit_at is None:
            return True
        return time.monotonic() - self._last_refit_at >= self.refit_s / self.config.worker.max_refit_share

    def _build_engine(self, version: int, path: Path) -> None:
        from echo2swarm.rollout.engines import make_engine
        from echo2swarm.rollout.engines.host import ProcessEngine
        from echo2swarm.rollout.engines.runner import ThreadRunner

        started = time.perf_counter()
        engine, pace = self.config.engine, self.config.worker.max_rollouts_per_s
        options: dict[str, Any] = dict(threads=engine.threads, max_batch_sequences=engine.max_batch_sequences,
                                       vllm_options=engine.vllm.model_dump(), device=engine.device)
        with self._lock:
            if engine.isolate:
                cpus = set(engine.cpus) if engine.cpus is not None else None
                self.engine = ProcessEngine(engine.type, path, version=version, cpus=cpus, pace_rollouts_per_s=pace,
                                            **options)
            else:
                self.engine = ThreadRunner(make_engine(engine.type, path, **options), version=version,
                                           pace_rollouts_per_s=pace)
            self.engine_version = version
            self._model_fp = _model_fingerprint(path)
        if self.config.worker.calibrate:
            self._calibrate()
        self.swap_s = time.perf_counter() - started

    async def _refit(self) -> None:
        """Queue a load of the newest installed version behind the batches already in the engine.

        Returns once it is queued: batches dispatched from then on run on it (they carry its
        version); its outcome is awaited in the background."""
        async with self._refit_lock:
            if self._newest is None or self.engine is None:
                return
            version, path = self._newest
            if self.engine_version is not None and version <= self.engine_version:
                return
            started = time.perf_counter()
            load, previous = await asyncio.to_thread(self._submit_load, version, path)
            self._last_refit_at = time.monotonic()
            task = asyncio.create_task(self._finish_refit(load, version, path, previous, started))
            self._refits.add(task)
            task.add_done_callback(self._refits.discard)

    def _submit_load(self, version: int, path: Path) -> tuple[Any, int | None]:
        with self._lock:
            previous = self.engine_version
            load = self.engine.submit_load(path, version)  # in place: no engine restart
            self.engine_version = version
            return load, previous

    async def _finish_refit(self, load: Any, version: int, path: Path, previous: int | None, started: float) -> None:
        from echo2swarm.rollout.engines.runner import EngineProcessError

        try:
            try:
                self.refit_s = await asyncio.wrap_future(load)
            except EngineProcessError as e:  # the host died: a new one starts on these weights
                self.stats["engine_errors"] += 1
                logger.warning("weight refit to v%d failed (%s); retrying in a new engine process", version, e)
                load, _ = await asyncio.to_thread(self._submit_load, version, path)
                self.refit_s = await asyncio.wrap_future(load)
        except Exception as e:  # noqa: BLE001 - the engine keeps the weights it had; batches queued for
            # this version are refused by it (VersionMismatch), and the next version or lease tries again
            with self._lock:
                if self.engine_version == version:
                    self.engine_version = previous
            if not self._closing:
                self.stats["refits_failed"] += 1
                logger.error("cannot load policy v%d into the engine: %s", version, e)
            return
        self.stats["refits"] += 1
        self.swap_s = time.perf_counter() - started

    def close(self) -> None:
        """Stop the engine (its process, or its thread once the batch under way ends)."""
        self._closing = True
        if self.engine is not None:
            self.engine.close()

    # -- throughput --------------------------------------------------------------------------------
    def _cache_key(self, n: int, max_new_tokens: int) -> str:
        c = self.config
        return (f"{c.engine.type}|{c.engine.device}|{self._model_fp}|threads={c.engine.threads}"
                f"|pace={c.worker.max_rollouts_per_s}"
                f"|n={n}|tokens={max_new_tokens}")

    def _read_cache(self) -> dict[str, Any]:
        try:
            data = json.loads(self._cache_path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _save_cache(self) -> None:
        if self.rollouts_per_s is None or self.sampling is None:
            return
        data = self._read_cache()
        data.setdefault("mu", {})[self._cache_key(*self.sampling)] = round(self.rollouts_per_s, 4)
        data["last_sampling"] = list(self.sampling)
        tmp = self._cache_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(self._cache_path)
        except OSError as e:
            logger.debug("cannot write the throughput cache: %s", e)

    def _calibrate(self) -> None:
        """µ before the first lease, so the learner can plan with this peer at once (runs in a thread)."""
        from echo2swarm.rollout.engines.base import SamplingParams

        w = self.config.worker
        cache = self._read_cache()
        last = cache.get("last_sampling")
        n, tokens = (last if isinstance(last, list) and len(last) == 2
                     else (w.calibration_group_size, w.calibration_max_new_tokens))
        self.sampling = (int(n), int(tokens))
        cached = cache.get("mu", {}).get(self._cache_key(*self.sampling))
        if isinstance(cached, (int, float)) and cached > 0:
            self.rollouts_per_s = float(cached)
            logger.info("throughput %.2f rollouts/s from the cache (%s)", cached, self._cache_path)
            return
        params = SamplingParams(n=self.sampling[0], max_new_tokens=self.sampling[1], temperature=1.0, top_p=1.0, seed=0)
        prompts = [f"{i}+{i}=" for i in range(w.calibration_prompts)]
        batch = self.engine.submit_generate(prompts, params, None).result()  # paced like any batch
        self.rollouts_per_s = len(prompts) * params.n / max(batch.busy_s, 1e-9)
        logger.info("calibrated: %.2f rollouts/s (%d prompts x %d, %d tokens)", self.rollouts_per_s,
                    len(prompts), params.n, params.max_new_tokens)
        self._save_cache()

    def _set_active(self, active: bool) -> None:
        if active != self.active:
            self.active = active
            logger.info("the learner made this peer %s", "active" if active else "standby")
            if self.ctx.announcer is not None:
                self.ctx.announcer.trigger()

    def _note_error(self, message: str) -> None:
        self.stats["rpc_errors"] += 1
        if message != self._last_error:  # one line per distinct problem, not per retry
            logger.warning("%s", message)
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
        collector = asyncio.create_task(self._collect(inflight, slots, pending))
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
        swarm = self.config.overlay.swarm
        cfg = self.config.worker
        while not stop.is_set():
            if not self._engine_ready.is_set():  # a lease taken now would expire while the engine starts
                await wait_any(stop, self._engine_ready, timeout=cfg.idle_retry_s)
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
                reply = await call_unary(
                    self.ctx.overlay.p2p, learner, rpc_name(swarm, "lease"),
                    # The newest version on disk, loaded or not: a lease that needs it loads it at once.
                    LeaseRequest(max_prompts=cfg.max_prompts, held_version=self._runnable_version(),
                                 wait_s=cfg.lease_wait_s),
                    (Lease, LeaseWait), cfg.rpc_timeout_s,
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
        newest = self._newest[0] if self._newest is not None else 0
        if (self.engine_version or 0) < lease.min_version:
            if newest < lease.min_version or self.engine_version is None:  # not installed, or the engine not built
                started = time.perf_counter()
                ok = await self.follower.wait_for(lease.min_version, timeout=lease.deadline_s / 2)
                self.stats["version_wait_s"] += time.perf_counter() - started
                if not ok:
                    self.stats["leases_abandoned"] += 1  # the learner re-issues it when it expires
                    logger.debug("lease %s abandoned: v%d not installed in time", lease.lease_id, lease.min_version)
                    return None
            await self._refit()  # needed now, whatever the refit budget says
            if (self.engine_version or 0) < lease.min_version:
                self.stats["leases_abandoned"] += 1
                logger.debug("lease %s abandoned: needs v%d, the engine holds v%s (newest installed: %s)",
                             lease.lease_id, lease.min_version, self.engine_version, self._newest)
                return None
        elif newest > (self.engine_version or 0) and (self.engine_version <= lease.min_version or self._refit_due()):
            # A version deferred for the refit budget: loaded once the budget allows, or at once when
            # the engine holds the oldest version this lease accepts, so that rollouts generated for
            # it are not one learner step away from being too stale to train on.
            await self._refit()
        if time.monotonic() - received > lease.deadline_s:  # held too long: the learner has re-issued it
            self.stats["leases_expired"] += 1
            return None
        spec = lease.sampling
        params = SamplingParams(n=spec.n, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                                top_p=spec.top_p, seed=spec.seed)
        try:
            # In a thread: taking the lock waits out a swap's submission, and a dead engine process
            # is restarted right there (seconds), neither of which may stall the event loop.
            future = await asyncio.to_thread(self._submit_batch, [p.text for p in lease.prompts], params)
        except EngineProcessError as e:  # no engine process could be started: counted, retried later
            self.stats["engine_errors"] += 1
            self.stats["leases_abandoned"] += 1
            self._backoff(f"cannot start the engine: {e}")
            return None
        self._engine_took()
        return asyncio.wrap_future(future)

    def _submit_batch(self, prompts: list[str], params: Any) -> Any:
        with self._lock:
            return self.engine.submit_generate(prompts, params, self.engine_version)

    def _backoff(self, message: str) -> None:
        self._backoff_until = time.monotonic() + self.config.worker.idle_retry_s
        if message != self._last_error:  # once per distinct problem, not per lease
            logger.error("%s", message)
            self._last_error = message

    async def _collect(self, inflight: asyncio.Queue[tuple[str, Lease, asyncio.Future[Any]] | None],
                       slots: asyncio.Semaphore, pending: set[asyncio.Task[None]]) -> None:
        """Take the engine's batches in order and submit each in a task of its own."""
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
                self.stats["engine_errors"] += 1
                self.stats["leases_abandoned"] += 1
                logger.error("generation failed: %s", e)
                continue
            except ValueError as e:  # a lease this engine cannot serve (e.g. vLLM and top_p < 1)
                self.stats["leases_abandoned"] += 1
                self._backoff(f"cannot generate for this learner's leases: {e}")
                continue
            finally:
                self._engine_gave()
                slots.release()
            groups = self._groups(lease, batch)
            await submits.acquire()  # back-pressure: at most max_pending_submits batches unsent
            task = asyncio.create_task(self._submit(learner, groups))
            pending.add(task)
            task.add_done_callback(lambda t: (pending.discard(t), submits.release()))

    async def _submit(self, learner: str, groups: list[GroupSubmission]) -> None:
        cfg = self.config.worker
        started = time.perf_counter()
        try:
            result = await call_client_stream(
                self.ctx.overlay.p2p, learner, rpc_name(self.config.overlay.swarm, "submit"), groups, SubmitResult,
                cfg.rpc_timeout_s,
            )
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
        rollouts = len(lease.prompts) * spec.n
        rate = rollouts / max(batch.busy_s, 1e-9)
        sampling = (spec.n, spec.max_new_tokens)
        alpha = self.config.worker.ewma_alpha
        if self.rollouts_per_s is None or sampling != self.sampling:  # other settings: start afresh
            self.rollouts_per_s = rate
        else:
            self.rollouts_per_s = (1 - alpha) * self.rollouts_per_s + alpha * rate
        self._leases_since_save += 1
        if sampling != self.sampling or self._leases_since_save >= 20:
            self.sampling = sampling
            self._leases_since_save = 0
            self._save_cache()
        self.stats["rollouts"] += rollouts
        self.stats["batches"] += 1
        self.stats["tokens"] += sum(len(c.token_ids) for group in batch.groups for c in group)
        return [
            GroupSubmission(
                lease_id=lease.lease_id, prompt_id=prompt.prompt_id, version=batch.version,
                completions=[CompletionMsg(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason)
                             for c in completions],
                generation_s=batch.busy_s / len(lease.prompts),
            )
            for prompt, completions in zip(lease.prompts, batch.groups)
        ]


def _model_fingerprint(path: Path) -> str:
    """The model's architecture (config.json), not its weights: throughput does not change with training."""
    try:
        return hashlib.sha256((Path(path) / "config.json").read_bytes()).hexdigest()[:16]
    except OSError:
        return "unknown"


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
