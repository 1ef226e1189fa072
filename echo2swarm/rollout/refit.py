"""The rollout engine and the policy version it holds: built on the first version, refitted in place after.

    installed version ─► first one? build the engine (its own process by default) ─► ready
                      └► else: refit budget allows? ─► queue the load behind the batches in the engine
                                                  └► no: defer (only the newest deferred one is kept)
    a lease needing a newer version, or arriving while the engine holds the oldest it accepts
        ─► the deferred version is loaded at once, whatever the budget says

The load is queued on the engine (runners keep requests in order), so batches already queued run
on the weights they were given and every batch carries its version. `worker.max_refit_share`
caps the share of the engine's time spent loading: a version is loaded at once when the last
load's seconds / share have passed since it was queued.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from echo2swarm.config.models import RolloutConfig
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

__all__ = ["EngineWeights"]


class EngineWeights:
    """The engine and its version, for the worker's loop (one per rollout daemon).

    Example::

        weights = EngineWeights(config, on_built=lambda engine, path: ...)
        await weights.on_version(7, Path("versions/7"))     # builds the engine
        await weights.on_version(8, Path("versions/8"))     # queued in place, or deferred
        future = weights.submit_batch(["1+2="], params)     # runs on weights.version
    """

    def __init__(self, config: RolloutConfig, stats: Counter[str] | None = None,
                 on_built: Callable[[Any, Path], None] | None = None):
        self.config = config
        # refits, refits_deferred, refits_failed, engine_errors; the worker counts its leases here too
        self.stats: Counter[str] = Counter() if stats is None else stats
        self.on_built = on_built  # runs in the build thread once the engine holds its first version
        self.engine: Any = None
        self.version: int | None = None  # of the weights the next batch submitted runs on
        self.loaded: int | None = None  # the last version the engine loaded: where a restarted engine process starts
        self.newest: tuple[int, Path] | None = None  # the newest installed version, loaded or not
        self.swap_s: float | None = None  # last on_version call, first engine build included
        self.refit_s: float | None = None  # last in-place weight reload, as the engine timed it
        self.ready = asyncio.Event()  # set once the first version is in a built engine
        self._lock = threading.Lock()
        self._last_refit_at: float | None = None  # monotonic time the last load was queued
        self._refit_lock = asyncio.Lock()
        self._refits: set[asyncio.Task[None]] = set()
        self._loading: set[int] = set()  # versions with a load queued on the engine and not finished
        self._closing = False

    async def on_version(self, version: int, path: Path) -> None:
        """A newly installed version: the first builds the engine; later ones are loaded in place at
        once, or, while loads would take more than `worker.max_refit_share` of the engine's time,
        when that budget allows or a lease needs them (only the newest waiting one is loaded)."""
        self.newest = (version, path)
        if self.engine is None:
            await asyncio.to_thread(self._build, version, path)
            self.ready.set()
        elif self.refit_due():
            await self.refit()
        else:
            self.stats["refits_deferred"] += 1

    def runnable_version(self) -> int | None:
        """The newest version this peer can generate with without fetching: loaded, or installed and deferred."""
        newest = self.newest[0] if self.newest is not None else None
        if newest is None or self.version is None:
            return self.version
        return max(newest, self.version)

    def in_use(self) -> set[int]:
        """Versions whose files the engine may still read: the last it loaded (a restarted engine
        process starts from it) and every one with a load queued. The follower's garbage collection
        keeps them, however many newer versions arrive meanwhile."""
        return self._loading | ({self.loaded} if self.loaded is not None else set())

    def refit_due(self) -> bool:
        """Whether the refit budget allows a load now."""
        if self.refit_s is None or self._last_refit_at is None:
            return True
        return time.monotonic() - self._last_refit_at >= self.refit_s / self.config.worker.max_refit_share

    async def refit(self) -> None:
        """Queue a load of the newest installed version behind the batches already in the engine.

        Returns once it is queued: batches submitted from then on run on it (they carry its
        version); its outcome is awaited in the background."""
        async with self._refit_lock:
            if self.newest is None or self.engine is None:
                return
            version, path = self.newest
            if self.version is not None and version <= self.version:
                return
            started = time.perf_counter()
            self._loading.add(version)
            try:
                load, previous = await asyncio.to_thread(self._submit_load, version, path)
            except BaseException:
                self._loading.discard(version)
                raise
            self._last_refit_at = time.monotonic()
            task = asyncio.create_task(self._finish_refit(load, version, path, previous, started))
            self._refits.add(task)
            task.add_done_callback(self._refits.discard)

    def submit_batch(self, prompts: list[str], params: Any) -> Any:
        """Queue a batch on the weights queued last (blocks while a load is being queued or a dead engine
        process restarts: call in a thread). Returns the runner's future of a `Batch`."""
        with self._lock:
            return self.engine.submit_generate(prompts, params, self.version)

    def close(self) -> None:
        """Stop the engine (its process, or its thread once the batch under way ends)."""
        self._closing = True
        if self.engine is not None:
            self.engine.close()

    def _build(self, version: int, path: Path) -> None:
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
            self.version = self.loaded = version
        if self.on_built is not None:
            self.on_built(self.engine, path)
        self.swap_s = time.perf_counter() - started

    def _submit_load(self, version: int, path: Path) -> tuple[Any, int | None]:
        with self._lock:
            previous = self.version
            load = self.engine.submit_load(path, version)  # in place: no engine restart
            self.version = version
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
                if self.version == version:
                    self.version = previous
            if not self._closing:
                self.stats["refits_failed"] += 1
                logger.error("cannot load policy v%d into the engine: %s", version, e)
            return
        finally:
            self._loading.discard(version)
        self.loaded = version if self.loaded is None else max(self.loaded, version)  # loads finish in order
        self.stats["refits"] += 1
        self.swap_s = time.perf_counter() - started
