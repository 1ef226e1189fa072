"""The rollout peer's work loop: lease prompts from the learner, generate, stream the groups back.

    learner = publisher of the trusted head ─► rpc_lease ─► [offer the lease's head to the follower]
        ─► wait until the engine holds ≥ min_version ─► engine.generate (thread) ─► rpc_submit

Double-buffering: the follower fetches the next version while the engine keeps generating with
the one it holds; the swap (`on_version`) takes the engine lock, so it lands between batches,
never inside one. Back-pressure comes from the learner: when it has enough work in flight it
answers `LeaseWait` and the worker asks again after the delay it names.
"""

from __future__ import annotations

import asyncio
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
        self.swap_s: float | None = None
        self._lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        self.rollouts_per_s: float | None = None  # EWMA of measured throughput
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
                                          max_batch_sequences=engine.max_batch_sequences)
            elif self.engine_version is None or version > self.engine_version:
                self.engine.load_weights(path)
            self.engine_version = version
        self.swap_s = time.perf_counter() - started

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
                await _sleep(stop, reply.retry_s)
                continue
            if (self.engine_version or 0) < reply.min_version:
                if not await self.follower.wait_for(reply.min_version, timeout=reply.deadline_s / 2):
                    self.stats["leases_abandoned"] += 1  # the learner re-issues it when it expires
                    continue
            groups = await asyncio.to_thread(self._generate, reply)
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
        seconds = time.perf_counter() - started
        rollouts = len(lease.prompts) * spec.n
        pace = self.config.worker.max_rollouts_per_s
        if pace is not None and rollouts / pace > seconds:  # emulate a slower device
            time.sleep(rollouts / pace - seconds)
            seconds = rollouts / pace
        rate = rollouts / max(seconds, 1e-9)
        self.rollouts_per_s = rate if self.rollouts_per_s is None else 0.8 * self.rollouts_per_s + 0.2 * rate
        self.stats["rollouts"] += rollouts
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


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    await wait_any(stop, timeout=seconds)
