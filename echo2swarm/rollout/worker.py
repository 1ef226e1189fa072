"""The rollout peer's work loop: lease prompts from the learner, generate, stream the groups back.

    learner = publisher of the trusted head ─► rpc_lease ─► [offer the lease's head to the follower]
        ─► wait until the engine holds ≥ min_version ─► engine.generate (thread) ─► rpc_submit

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
from typing import Any

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
        swarm = self.config.overlay.swarm
        cfg = self.config.worker
        while not stop.is_set():
            # Only the learner whose signed head we trust gets our work; a card claiming to be a
            # learner is not enough (anyone can announce one).
            learner = self.follower.publisher
            if learner is None:
                await _sleep(stop, cfg.idle_retry_s)
                continue
            try:
                reply = await call_unary(
                    self.ctx.overlay.p2p, learner, rpc_name(swarm, "lease"),
                    LeaseRequest(max_prompts=cfg.max_prompts, held_version=self.engine_version),
                    (Lease, LeaseWait), cfg.rpc_timeout_s,
                )
            except RpcError as e:
                self._note_error(f"lease request failed: {e}")
                await _sleep(stop, cfg.idle_retry_s)
                continue
            if reply.head:
                self.follower.offer(reply.head)
            if isinstance(reply, LeaseWait):
                self.stats["waits"] += 1
                if reply.standby or self.active is not None:
                    self._set_active(not reply.standby)
                waited = time.perf_counter()
                await _sleep(stop, reply.retry_s)
                self.stats["wait_s"] += time.perf_counter() - waited  # idle for lack of work, not our overhead
                continue
            self._set_active(True)
            if (self.engine_version or 0) < reply.min_version:
                if not await self.follower.wait_for(reply.min_version, timeout=reply.deadline_s / 2):
                    self.stats["leases_abandoned"] += 1  # the learner re-issues it when it expires
                    continue
            try:
                groups = await asyncio.to_thread(self._generate, reply)
            except ValueError as e:  # a lease this engine cannot serve (e.g. vLLM and top_p < 1)
                self.stats["leases_abandoned"] += 1
                if str(e) != self._last_error:  # once per distinct problem, not per lease
                    logger.error("cannot generate for this learner's leases: %s", e)
                    self._last_error = str(e)
                await _sleep(stop, cfg.idle_retry_s)
                continue
            try:
                result = await call_client_stream(
                    self.ctx.overlay.p2p, learner, rpc_name(swarm, "submit"), groups, SubmitResult, cfg.rpc_timeout_s
                )
            except RpcError as e:
                self._note_error(f"submit failed: {e}")
                continue
            self.stats["groups_accepted"] += result.accepted
            for reason, n in result.refused.items():
                self.stats[f"refused_{reason}"] += n

    def _generate(self, lease: Lease) -> list[GroupSubmission]:
        from echo2swarm.rollout.engines.base import SamplingParams

        spec = lease.sampling
        params = SamplingParams(n=spec.n, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                                top_p=spec.top_p, seed=spec.seed)
        started = time.perf_counter()
        with self._lock:
            version = self.engine_version
            outputs = self.engine.generate([p.text for p in lease.prompts], params)
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
