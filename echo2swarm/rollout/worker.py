"""The rollout peer's work loop: lease prompts from the learner, generate, stream the groups back.

    learner = publisher of the trusted head ─► rpc_lease ─► [offer the lease's head to the follower]
        ─► wait until the engine holds ≥ min_version ─► engine.generate (thread) ─► rpc_submit

The three stages overlap: the next lease is asked for while a batch generates
(`worker.prefetch_leases`) and finished batches are submitted while the next one generates
(`worker.max_pending_submits`), so on a fast engine the round trips to the learner cost no
generation time.

Double-buffering: the follower fetches the next version while the engine keeps generating with
the one it holds; the swap (`on_version`) takes the engine lock, so it lands between batches,
never inside one. Back-pressure comes from the learner: when it has enough work in flight it
answers `LeaseWait` and the worker asks again after the delay it names; when its cost-aware plan
keeps this peer on standby it says so (`LeaseWait.standby`), and the card shows `active: false`.

Throughput µ: measured once when the engine loads (a short calibration batch, cached in the state
dir per engine, device, model, threads, pace and sampling settings, so a restart skips it), then an
EWMA over real leases; advertised in the card as `rollouts_per_s` for the learner's planner.
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
        self._generating_from: float | None = None

    # -- weights ------------------------------------------------------------------------------
    async def on_version(self, version: int, path: Path) -> None:
        await asyncio.to_thread(self._swap, version, path)

    def _swap(self, version: int, path: Path) -> None:
        from echo2swarm.rollout.engines import make_engine

        started = time.perf_counter()
        with self._lock:
            if self.engine is None:
                engine = self.config.engine
                self.engine = make_engine(engine.type, path, threads=engine.threads,
                                          max_batch_sequences=engine.max_batch_sequences,
                                          vllm_options=engine.vllm.model_dump(), device=engine.device)
                self._model_fp = _model_fingerprint(path)
                if self.config.worker.calibrate:
                    self._calibrate()
            elif self.engine_version is None or version > self.engine_version:
                self.refit_s = self.engine.load_weights(path)  # in place: no engine restart
            self.engine_version = version
        self.swap_s = time.perf_counter() - started

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
        """µ before the first lease, so the learner can plan with this peer at once. Engine lock held."""
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
        started = time.perf_counter()
        self.engine.generate(prompts, params)
        seconds = self._pace(len(prompts) * params.n, time.perf_counter() - started)
        self.rollouts_per_s = len(prompts) * params.n / max(seconds, 1e-9)
        logger.info("calibrated: %.2f rollouts/s (%d prompts x %d, %d tokens)", self.rollouts_per_s,
                    len(prompts), params.n, params.max_new_tokens)
        self._save_cache()

    def _pace(self, rollouts: int, seconds: float) -> float:
        """Sleep to emulate a slower device (worker.max_rollouts_per_s); returns the paced duration."""
        pace = self.config.worker.max_rollouts_per_s
        if pace is not None and rollouts / pace > seconds:
            time.sleep(rollouts / pace - seconds)
            return rollouts / pace
        return seconds

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

            lease loop ─► queue (worker.prefetch_leases ahead) ─► generate ─► submit tasks (bounded)

        The next lease is asked for while the current batch generates, and a finished batch is
        submitted while the next one generates. Seconds the engine sits idle are counted: `wait_s`
        when the learner had no work for us (its limit), `starved_s` when a round trip was not hidden.
        """
        cfg = self.config.worker
        queue: asyncio.Queue[tuple[str, Lease, float]] = asyncio.Queue()
        slots = asyncio.Semaphore(cfg.prefetch_leases + 1)  # leases held and not yet generated
        submits = asyncio.Semaphore(cfg.max_pending_submits)
        pending: set[asyncio.Task[None]] = set()
        leaser = asyncio.create_task(self._lease_loop(queue, slots, stop))
        try:
            while not stop.is_set():
                self._idle_from = (time.perf_counter(), self._told_to_wait_s())
                got = await _get(queue, stop)
                self.stats.update(self._idle_split())
                self._idle_from = None
                if got is None:
                    break
                learner, lease, received = got
                try:
                    groups = await self._serve(lease, received, stop)
                finally:
                    slots.release()
                if not groups:
                    continue
                await submits.acquire()  # back-pressure: at most max_pending_submits batches unsent
                task = asyncio.create_task(self._submit(learner, groups))
                pending.add(task)
                task.add_done_callback(lambda t: (pending.discard(t), submits.release()))
        finally:
            leaser.cancel()
            await asyncio.gather(leaser, return_exceptions=True)
            if pending:  # groups already generated: give them their chance to land
                await asyncio.wait(pending, timeout=cfg.rpc_timeout_s)

    async def _lease_loop(self, queue: asyncio.Queue[tuple[str, Lease, float]], slots: asyncio.Semaphore,
                          stop: asyncio.Event) -> None:
        swarm = self.config.overlay.swarm
        cfg = self.config.worker
        while not stop.is_set():
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
                    LeaseRequest(max_prompts=cfg.max_prompts, held_version=self.engine_version,
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
            queue.put_nowait((learner, reply, time.monotonic()))

    def _idle_split(self) -> dict[str, float]:
        """The engine's idle interval under way, split: learner had no work (`wait_s`) / round trip (`starved_s`)."""
        if self._idle_from is None:
            return {}
        since, told = self._idle_from
        idle = time.perf_counter() - since
        waited = min(idle, self._told_to_wait_s() - told)
        return {"wait_s": waited, "starved_s": idle - waited}

    def snapshot(self) -> dict[str, float]:
        """Counters as of now, the idle or generating interval under way included (exact windows for benchmarks)."""
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

    async def _serve(self, lease: Lease, received: float, stop: asyncio.Event) -> list[GroupSubmission]:
        """Generate one lease's groups; [] when the lease cannot or should no longer be served."""
        cfg = self.config.worker
        if (self.engine_version or 0) < lease.min_version:
            started = time.perf_counter()
            ok = await self.follower.wait_for(lease.min_version, timeout=lease.deadline_s / 2)
            self.stats["version_wait_s"] += time.perf_counter() - started
            if not ok:
                self.stats["leases_abandoned"] += 1  # the learner re-issues it when it expires
                return []
        if time.monotonic() - received > lease.deadline_s:  # held too long: the learner has re-issued it
            self.stats["leases_expired"] += 1
            return []
        try:
            return await asyncio.to_thread(self._generate, lease)
        except ValueError as e:  # a lease this engine cannot serve (e.g. vLLM and top_p < 1)
            self.stats["leases_abandoned"] += 1
            if str(e) != self._last_error:  # once per distinct problem, not per lease
                logger.error("cannot generate for this learner's leases: %s", e)
                self._last_error = str(e)
            await _sleep(stop, cfg.idle_retry_s)
            return []

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

    def _generate(self, lease: Lease) -> list[GroupSubmission]:
        from echo2swarm.rollout.engines.base import SamplingParams

        spec = lease.sampling
        params = SamplingParams(n=spec.n, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                                top_p=spec.top_p, seed=spec.seed)
        started = self._generating_from = time.perf_counter()
        try:
            with self._lock:
                version = self.engine_version
                outputs = self.engine.generate([p.text for p in lease.prompts], params)
        finally:
            self._generating_from = None  # before adding: a snapshot in between undercounts, never doubles
            self.stats["generate_s"] += time.perf_counter() - started
        rollouts = len(lease.prompts) * spec.n
        seconds = self._pace(rollouts, time.perf_counter() - started)
        rate = rollouts / max(seconds, 1e-9)
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
        self.stats["tokens"] += sum(len(c.token_ids) for group in outputs for c in group)
        assert version is not None
        return [
            GroupSubmission(
                lease_id=lease.lease_id, prompt_id=prompt.prompt_id, version=version,
                completions=[CompletionMsg(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason)
                             for c in completions],
                generation_s=seconds / len(lease.prompts),
            )
            for prompt, completions in zip(lease.prompts, outputs)
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
