"""A rollout peer's throughput µ (rollouts per engine second), as it advertises it to the learner.

    engine built ─► cached µ for these settings? ─► else one calibration batch ─► µ
    each lease's batch ─► EWMA over (rollouts / seconds the engine spent on it) ─► µ
    every 20 leases, or when the lease's sampling changes ─► <state_dir>/throughput.json

The cache is keyed by engine, device, model architecture (config.json, not the weights: training
does not change speed), threads, pacing and the sampling settings, so a restarted peer is
plannable at once without re-measuring.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from echo2swarm.config.models import RolloutConfig
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

__all__ = ["Throughput"]

_SAVE_EVERY = 20  # leases between cache writes


class Throughput:
    """µ for the learner's planner: calibrated once, then an EWMA of real leases.

    Example::

        mu = Throughput(config, Path("state/throughput.json"))
        mu.calibrate(engine, model_dir)          # cached value or one short batch
        mu.observe(n=8, max_new_tokens=16, rollouts=64, busy_s=0.8)
        mu.rollouts_per_s                        # -> 80.0 after the first lease
    """

    def __init__(self, config: RolloutConfig, cache_path: Path):
        self.config = config
        self.cache_path = cache_path
        self.rollouts_per_s: float | None = None
        self.sampling: tuple[int, int] | None = None  # (group size, max new tokens) µ was measured for
        self._model_fp = ""
        self._since_save = 0

    def calibrate(self, engine: Any, model_dir: Path) -> None:
        """µ before the first lease, from the cache or one paced batch on `engine` (blocks: call in a thread)."""
        from echo2swarm.rollout.engines.base import SamplingParams

        self._model_fp = _model_fingerprint(model_dir)
        w = self.config.worker
        if not w.calibrate:
            return
        cache = self._read()
        last = cache.get("last_sampling")
        n, tokens = (last if isinstance(last, list) and len(last) == 2
                     else (w.calibration_group_size, w.calibration_max_new_tokens))
        self.sampling = (int(n), int(tokens))
        mu = cache.get("mu")
        cached = mu.get(self._key(*self.sampling)) if isinstance(mu, dict) else None
        if isinstance(cached, (int, float)) and cached > 0:
            self.rollouts_per_s = float(cached)
            logger.info("throughput %.2f rollouts/s from the cache (%s)", cached, self.cache_path)
            return
        params = SamplingParams(n=self.sampling[0], max_new_tokens=self.sampling[1], temperature=1.0, top_p=1.0, seed=0)
        prompts = [f"{i}+{i}=" for i in range(w.calibration_prompts)]
        batch = engine.submit_generate(prompts, params, None).result()  # paced like any batch
        self.rollouts_per_s = len(prompts) * params.n / max(batch.busy_s, 1e-9)
        logger.info("calibrated: %.2f rollouts/s (%d prompts x %d, %d tokens)", self.rollouts_per_s,
                    len(prompts), params.n, params.max_new_tokens)
        self._save()

    def observe(self, n: int, max_new_tokens: int, rollouts: int, busy_s: float) -> None:
        """One lease's batch: `rollouts` generated in `busy_s` engine seconds with these sampling settings."""
        rate = rollouts / max(busy_s, 1e-9)
        sampling = (n, max_new_tokens)
        alpha = self.config.worker.ewma_alpha
        if self.rollouts_per_s is None or sampling != self.sampling:  # other settings: start afresh
            self.rollouts_per_s = rate
        else:
            self.rollouts_per_s = (1 - alpha) * self.rollouts_per_s + alpha * rate
        self._since_save += 1
        if sampling != self.sampling or self._since_save >= _SAVE_EVERY:
            self.sampling = sampling
            self._since_save = 0
            self._save()

    def _key(self, n: int, max_new_tokens: int) -> str:
        c = self.config
        return (f"{c.engine.type}|{c.engine.device}|{self._model_fp}|threads={c.engine.threads}"
                f"|pace={c.worker.max_rollouts_per_s}"
                f"|n={n}|tokens={max_new_tokens}")

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.cache_path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _save(self) -> None:
        if self.rollouts_per_s is None or self.sampling is None:
            return
        data = self._read()
        mu = data.get("mu")
        data["mu"] = mu if isinstance(mu, dict) else {}
        data["mu"][self._key(*self.sampling)] = round(self.rollouts_per_s, 4)
        data["last_sampling"] = list(self.sampling)
        tmp = self.cache_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(self.cache_path)
        except OSError as e:
            logger.debug("cannot write the throughput cache: %s", e)


def _model_fingerprint(path: Path) -> str:
    """The model's architecture (config.json), not its weights: throughput does not change with training."""
    try:
        return hashlib.sha256((Path(path) / "config.json").read_bytes()).hexdigest()[:16]
    except OSError:
        return "unknown"
